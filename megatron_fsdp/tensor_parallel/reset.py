"""The reset_parameters() of megatron_fsdp's layers (one definition for all of them)."""

from __future__ import annotations


class ResetsDeclaredParameters:
    """Mixed into a layer that declares its parameters' inits (utils.record_init)."""

    def reset_parameters(self) -> None:
        """Draw this layer's initial values again, as its build does (each rank keeps its part).
        A meta-device model: megatron_fsdp.initialization.initialize_parameters."""
        # Imported here: megatron_fsdp.initialization imports this package.
        from ..initialization import reset_recorded_parameters

        reset_recorded_parameters(self)
