"""Drop-in Flax NNX layers whose trainable operations learn online (``braintrace.layers``)."""

__all__: list[str] = []
