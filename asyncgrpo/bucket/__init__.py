"""The bucket every run lives in: its backends, and where each object lives in it.

Modules:
    backends  the `Bucket` interface, `ObjectInfo`, the errors and the key rules; the `file://` backend (atomic
              writes, create-only by link) and the `s3://` backend (If-None-Match, multipart); `open_bucket(url)`
    layout    every bucket key (nothing else formats keys); version manifests: files first, manifest last;
              verified reads and fetches
"""
