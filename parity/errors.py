"""Errors with a one-line message that names the thing and the fix."""


class UsageError(ValueError):
    """Bad input from the user (unknown fixture, path, dtype, matrix...). The CLI exits 2."""


class IsolationError(ValueError):
    """A dtype-split path cannot give a distinct-dtype parameter its own FSDP unit."""

    def __init__(self, params: list[str], fallback_reason: str = "", *, path: str = "legacy"):
        self.params = params
        self.fallback_reason = fallback_reason
        self.path = path
        """The path whose plan raised (after any fallback)."""
        prefix = f"fell back to {path} ({fallback_reason}); " if fallback_reason else ""
        super().__init__(
            prefix + f"{path} dtype-split cannot isolate "
            + ", ".join(params)
            + ": each shares its owning module with parameters of another (storage, compute) "
            "dtype; move it into its own submodule (a holder module) or use the native path"
        )


class RankMismatchError(RuntimeError):
    """Ranks resolved different compute dtypes for the same parameter."""
