"""``python -m braintrace``: a short demonstration of the ETP primitives."""

import jax
import jax.numpy as jnp

import braintrace


def main() -> None:
    """Shows a dense ETP primitive in a jaxpr and its gradient."""
    x = jnp.ones((4, 3))
    kernel = jnp.arange(6.0).reshape(3, 2)
    print("jaxpr of braintrace.matmul:")
    print(jax.make_jaxpr(braintrace.matmul)(x, kernel))
    grad = jax.grad(lambda k: jnp.sum(braintrace.matmul(x, k) ** 2))(kernel)
    print("gradient of sum((x @ kernel)^2):")
    print(grad)


if __name__ == "__main__":
    main()
