"""Where runs keep their files: local paths and gs:// / s3:// URLs alike (`paths`), bucket clients,
settings and the early access check (`object_store`), small whole files written atomically
(`small_files`) and logs that are only appended to (`appended_log`). Imports no JAX: the launcher
and the run logs use it too.
"""
