"""What every process of a run shares, and the command line that starts each of them.

The coordinator (`proxy`) and the workers (`worker`) never import each other: they meet over HTTP, Redis and
the bucket, and this package is the vocabulary of that meeting. Import-linter contracts in pyproject.toml
hold the directions: `cli` > `proxy` | `worker` > `run` > `bucket` > `protocol`.

Packages:
    protocol  the wire: messages, stored records, error codes, the proxy client, settings base, logging
    bucket    the bucket: its interface, its file and S3 backends, every key, version manifests
    run       a run as stored in the bucket: its config, its prompts, creating and loading it
    cli       the `asyncgrpo` command line, the entry of every process, and the tools it runs for people
"""
