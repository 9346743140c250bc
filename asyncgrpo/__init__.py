"""What every process of a run shares: the vocabulary the coordinator and the workers meet in.

The coordinator (`proxy`) and the workers (`worker`) never import each other: they meet over HTTP, Redis and
the bucket, and this package is the vocabulary of that meeting. It stands alone: it imports neither `proxy`,
`worker` nor the command line (`cli`) above them. Import-linter contracts in pyproject.toml hold the
directions: `cli` > `proxy` | `worker` > `run` > `bucket` > `protocol`, and this package imports none of the
three above it.

Packages:
    protocol  the wire: messages, stored records, error codes, the proxy client, settings base, logging
    bucket    the bucket: its interface, its file and S3 backends, every key, version manifests
    run       a run as stored in the bucket: its config, its prompts, creating and loading it
"""
