"""Errors with a one-line message that names the thing and the fix."""


class UsageError(ValueError):
    """Bad input from the user (unknown fixture, path, dtype, matrix...). The CLI exits 2."""


class IsolationError(ValueError):
    """Legacy dtype-split cannot give a distinct-dtype parameter its own FSDP unit."""

    def __init__(self, params: list[str], fallback_reason: str = ""):
        self.params = params
        self.fallback_reason = fallback_reason
        prefix = f"native fell back to legacy ({fallback_reason}); " if fallback_reason else ""
        super().__init__(
            prefix + "legacy dtype-split cannot isolate "
            + ", ".join(params)
            + ": each shares its owning module with parameters of another (storage, compute) "
            "dtype; move it into its own submodule (a holder module) or use the native path"
        )


class RankMismatchError(RuntimeError):
    """Ranks resolved different compute dtypes for the same parameter."""
