"""The bucket every run lives in: its interface, its backends, its keys and its manifests.

Modules:
    interface     the `Bucket` interface, `ObjectInfo`, the errors and the key rules
    file_backend  the `file://` backend: atomic writes, create-only by link
    s3_backend    the `s3://` backend: If-None-Match, multipart
    backends      `open_bucket(url)`, and every bucket name importable from one place
    keys          every bucket key; nothing else formats keys
    manifest      version manifests: files first, manifest last; verified reads and fetches
"""
