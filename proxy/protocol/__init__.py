"""protocol.

- ``settings``: the environment settings every process shares (``ASYNCGRPO_*``), on pydantic-settings.
"""
