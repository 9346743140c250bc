"""Two commands' own output: ``asyncgrpo model tiny`` builds a loadable model, ``asyncgrpo status`` shows the newest
eval."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from asyncgrpo.protocol.schemas import EvalSummary, StatusResponse
from cli.main import main
from cli.status import eval_line


def test_cli_builds_the_model(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["model", "tiny", "--out", str(tmp_path / "tiny"), "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "tiny" / "config.json").is_file()
    assert (tmp_path / "tiny" / "tokenizer.json").is_file()
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "tiny").num_parameters() > 0


def test_status_line_shows_the_newest_eval() -> None:
    status = StatusResponse.model_validate(
        {
            "run": "r",
            "current_version": 4,
            "final_version": 4,
            "finished": True,
            "step_inflight": None,
            "epoch": 0,
            "epoch_pos": 0,
            "groups_buffered": 0,
            "groups_inflight": 0,
            "groups_requeued": 0,
            "tasks_inflight": 0,
            "counters": {},
            "rejected_by_reason": {},
            "leases": [],
            "workers_alive_by_role": {},
            "evals_pending": 1,
        }
    )
    assert eval_line(status) == "none yet; 1 version(s) pending"
    status.eval_latest = EvalSummary(version=2, metrics={"reward": 0.5, "pass@4": 0.75, "pass@1": 0.25})
    assert eval_line(status) == "v2: reward 0.5, pass@1 0.25, pass@4 0.75; 1 version(s) pending"
