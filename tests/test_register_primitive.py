"""register_primitive: auto-derived JAX rules, layout declaration, ETP rules, errors."""

from __future__ import annotations

import itertools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace import MissingRuleError, register_batched_counterpart, register_primitive

_IDS = itertools.count()


def _name(tag: str) -> str:
    """A primitive name no other test uses."""
    return f"test_regprim_{tag}_{next(_IDS)}"


def _impl(x, w):
    """A nonlinear per-sample map ``x: (I,)``, ``w: (I, O)`` -> ``(O,)``."""
    return jnp.sin(x @ w) + jnp.sum(x) * jnp.cos(w[0])


def _operands(dtype=jnp.float32, batch=None, i=3, o=4):
    kx, kw = jax.random.split(jax.random.key(0))
    shape = (i,) if batch is None else (batch, i)
    x = jax.random.normal(kx, shape, dtype)
    w = jax.random.normal(kw, (i, o), dtype)
    return x, w


def _primitives_in(jaxpr) -> list[str]:
    """Names of every primitive in a closed jaxpr, sub-jaxprs included."""
    names = []

    def subjaxprs(value):
        if isinstance(value, (tuple, list)):
            for v in value:
                yield from subjaxprs(v)
        elif hasattr(value, "eqns"):
            yield value
        elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
            yield value.jaxpr

    def walk(jx):
        for eqn in jx.eqns:
            names.append(eqn.primitive.name)
            for value in eqn.params.values():
                for sub in subjaxprs(value):
                    walk(sub)

    walk(jaxpr.jaxpr)
    return names


def _close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


# -- values and derivatives ---------------------------------------------------


def test_values_eager_jit_nested_jit():
    p = register_primitive(_name("values"), _impl)
    x, w = _operands()
    expected = _impl(x, w)
    _close(p(x, w), expected)
    _close(jax.jit(p)(x, w), expected)
    _close(jax.jit(lambda x, w: jax.jit(p)(x, w) * 2.0)(x, w), 2.0 * expected)
    assert p(x, w).shape == expected.shape
    assert p(x, w).dtype == expected.dtype


def test_primitive_appears_as_itself_in_ad_free_jaxpr():
    name = _name("jaxpr")
    p = register_primitive(name, _impl)
    x, w = _operands()
    jaxpr = jax.make_jaxpr(lambda x, w: jnp.tanh(p(x, w)))(x, w)
    assert _primitives_in(jaxpr).count(name) == 1
    eqn = next(e for e in jaxpr.jaxpr.eqns if e.primitive is p)
    assert [v.aval.shape for v in eqn.invars] == [(3,), (3, 4)]
    assert eqn.outvars[0].aval.shape == (4,)
    # Inside jit the primitive stays visible in the sub-jaxpr.
    jitted = jax.make_jaxpr(jax.jit(lambda x, w: p(x, w)))(x, w)
    assert name in _primitives_in(jitted)


@pytest.mark.parametrize("wrap", ["eager", "jit", "nested_jit"])
def test_grad_matches_impl(wrap):
    p = register_primitive(_name("grad"), _impl)
    x, w = _operands()
    loss = lambda f: lambda x, w: jnp.sum(f(x, w) ** 2)
    wrappers = {
        "eager": lambda f: f,
        "jit": jax.jit,
        "nested_jit": lambda f: jax.jit(lambda *a: jax.jit(f)(*a)),
    }
    got = wrappers[wrap](jax.grad(loss(p), argnums=(0, 1)))(x, w)
    want = jax.grad(loss(_impl), argnums=(0, 1))(x, w)
    for g, e in zip(got, want, strict=True):
        _close(g, e)
    assert float(jnp.abs(want[1]).sum()) > 0


def test_jvp_vjp_and_second_order_match_impl():
    p = register_primitive(_name("jvp"), _impl)
    x, w = _operands()
    tx, tw = x[::-1], w[::-1]
    y, ty = jax.jvp(p, (x, w), (tx, tw))
    y0, ty0 = jax.jvp(_impl, (x, w), (tx, tw))
    _close(y, y0)
    _close(ty, ty0)
    ct = jnp.arange(4.0) - 1.5
    _, pull = jax.vjp(p, x, w)
    _, pull0 = jax.vjp(_impl, x, w)
    for g, e in zip(pull(ct), pull0(ct), strict=True):
        _close(g, e)

    # Jacobians and the Hessian, compiled (jit traces the same JVP rule).
    def derivatives(f):
        return (jax.jvp(f, (x, w), (tx, tw))[1],
                jax.jacfwd(f, argnums=1)(x, w),
                jax.jacrev(f, argnums=0)(x, w),
                jax.hessian(lambda x: jnp.sum(f(x, w)))(x))

    got = jax.jit(lambda: derivatives(p))()
    want = jax.jit(lambda: derivatives(_impl))()
    for g, e in zip(got, want, strict=True):
        _close(g, e, tol=1e-4)


def test_float64_derivatives_match_impl():
    p = register_primitive(_name("f64"), _impl)
    with jax.enable_x64(True):
        x, w = _operands(jnp.float64)
        got = jax.jit(jax.grad(lambda w: jnp.sum(p(x, w) ** 3)))(w)
        want = jax.jit(jax.grad(lambda w: jnp.sum(_impl(x, w) ** 3)))(w)
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_python_scalar_operand_keeps_weak_type_under_x64():
    # Regression: abstract evaluation dropped weak types, so `2.0 * float32`
    # was declared float64 under x64 while the lowered impl produced float32.
    p = register_primitive(_name("weak"), lambda s, w: s * w)
    with jax.enable_x64(True):
        w = jnp.ones(3, jnp.float32)
        eager = p(2.0, w)
        jitted = jax.jit(lambda w: p(2.0, w))(w)
        assert eager.dtype == jitted.dtype == jnp.float32
        _close(jitted, 2.0 * w)
        assert jax.grad(lambda w: jnp.sum(p(2.0, w)))(w).dtype == jnp.float32


# -- integer and boolean operands ----------------------------------------------


def test_integer_spike_counts_under_grad_and_jvp():
    p = register_primitive(_name("int"), _impl)
    counts = jnp.array([0, 2, 1], jnp.int32)
    _, w = _operands()
    _close(p(counts, w), _impl(counts, w))
    loss = lambda f: lambda w: jnp.sum(f(counts, w) ** 2)
    _close(jax.grad(loss(p))(w), jax.grad(loss(_impl))(w))
    _close(jax.jit(jax.grad(loss(p)))(w), jax.grad(loss(_impl))(w))
    tw = jnp.ones_like(w)
    zero = np.zeros(counts.shape, jax.dtypes.float0)
    _, ty = jax.jvp(p, (counts, w), (zero, tw))
    _, ty0 = jax.jvp(_impl, (counts, w), (zero, tw))
    _close(ty, ty0)
    # The integer operand's tangent is a symbolic zero when only w is differentiated.
    _, ty_w = jax.jvp(lambda w: p(counts, w), (w,), (tw,))
    _close(ty_w, ty0)


def test_boolean_mask_operand_under_grad():
    p = register_primitive(_name("mask"), lambda m, w: jnp.where(m, jnp.exp(w), 0.0))
    mask = jnp.array([True, False, True, True])
    w = jnp.linspace(-1.0, 1.0, 4)
    _close(p(mask, w), jnp.where(mask, jnp.exp(w), 0.0))
    g = jax.grad(lambda w: jnp.sum(p(mask, w)))(w)
    _close(g, jnp.where(mask, jnp.exp(w), 0.0))
    g_jit = jax.jit(jax.grad(lambda w: jnp.sum(p(mask, w))))(w)
    _close(g_jit, g)


# -- trainable layouts -----------------------------------------------------------


def test_dense_like_kernel_and_bias():
    impl = lambda x, k, b: jnp.tanh(x @ k + b)
    p = register_primitive(_name("kb"), impl,
                           trainable_invars_fn=lambda params: {"kernel": 1, "bias": 2})
    assert p.trainable_invars({}) == {"kernel": 1, "bias": 2}
    x, k = _operands()
    b = jnp.arange(4.0) / 4
    loss = lambda f: lambda k, b: jnp.sum(f(x, k, b) ** 2)
    got = jax.grad(loss(p), argnums=(0, 1))(k, b)
    want = jax.grad(loss(impl), argnums=(0, 1))(k, b)
    for g, e in zip(got, want, strict=True):
        _close(g, e)


def test_lora_like_three_trainables_layout_depends_on_params():
    def impl(x, a, b, *bias, has_bias):
        y = (x @ a) @ b
        return y + bias[0] if has_bias else y

    def layout(params):
        out = {"lora_a": 1, "lora_b": 2}
        if params["has_bias"]:
            out["bias"] = 3
        return out

    p = register_primitive(_name("lora"), impl, trainable_invars_fn=layout)
    assert p.trainable_invars({"has_bias": True}) == {"lora_a": 1, "lora_b": 2, "bias": 3}
    assert p.trainable_invars({"has_bias": False}) == {"lora_a": 1, "lora_b": 2}
    x = jnp.arange(5.0)
    a = jnp.ones((5, 2)) * 0.1
    b = jnp.arange(6.0).reshape(2, 3)
    bias = jnp.array([1.0, -1.0, 0.5])
    _close(p(x, a, b, bias, has_bias=True), impl(x, a, b, bias, has_bias=True))
    _close(p(x, a, b, has_bias=False), impl(x, a, b, has_bias=False))
    f = lambda g: lambda a, b, c: jnp.sum(jnp.sin(g(x, a, b, c, has_bias=True)))
    got = jax.grad(f(p), argnums=(0, 1, 2))(a, b, bias)
    want = jax.grad(f(impl), argnums=(0, 1, 2))(a, b, bias)
    for g, e in zip(got, want, strict=True):
        _close(g, e)
    eqn = jax.make_jaxpr(lambda *o: p(*o, has_bias=True))(x, a, b, bias).jaxpr.eqns[0]
    assert eqn.primitive is p and eqn.params == {"has_bias": True}


def test_default_layout_is_single_weight():
    p = register_primitive(_name("default"), _impl)
    assert p.trainable_invars({"anything": 1}) == {"weight": 1}
    assert p.x_invar_index == 0 and p.y_outvar_index == 0
    assert not p.batched and not p.gradient_enabled
    assert p.batched_counterpart is None


def test_no_input_primitive():
    name = _name("noinput")
    p = register_primitive(name, lambda w: jnp.exp(-1.0 / w), gradient_enabled=True,
                           trainable_invars_fn=lambda params: {"weight": 0},
                           x_invar_index=None)
    assert p.x_invar_index is None and p.gradient_enabled
    w = jnp.array([1.0, 2.0, 4.0])
    _close(p(w), jnp.exp(-1.0 / w))
    _close(jax.grad(lambda w: jnp.sum(p(w)))(w), jnp.exp(-1.0 / w) / w**2)
    assert name in _primitives_in(jax.make_jaxpr(p)(w))
    # Mapping the weight has nothing to batch over: it falls back, with a warning.
    with pytest.warns(UserWarning, match=re.escape(name)):
        out = jax.vmap(p)(jnp.stack([w, 2 * w]))
    _close(out, jnp.exp(-1.0 / jnp.stack([w, 2 * w])))
    with pytest.raises(ValueError, match="no input x"):
        register_batched_counterpart(p, register_primitive(_name("noinput_b"), lambda w: w))


def test_primitive_not_batched_when_its_operands_are_unmapped():
    name = _name("unmapped")
    p = register_primitive(name, lambda w: 2 * w, x_invar_index=None,
                           trainable_invars_fn=lambda params: {"weight": 0})
    w = jnp.ones(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxpr = jax.make_jaxpr(jax.vmap(lambda h: p(w) * h))(jnp.ones((5, 3)))
    assert name in _primitives_in(jaxpr)


# -- batching ----------------------------------------------------------------------


def _pair(tag, impl=_impl):
    one = register_primitive(_name(tag), impl)
    many = register_primitive(_name(tag + "_batched"), jax.vmap(impl, (0, None)), batched=True)
    register_batched_counterpart(one, many)
    return one, many


@pytest.mark.parametrize("in_axis", [0, 1])
def test_vmap_with_counterpart_binds_it_batch_leading(in_axis):
    one, many = _pair("vmapc")
    xb, w = _operands(batch=5)
    xin = jnp.moveaxis(xb, 0, in_axis)
    f = jax.vmap(one, in_axes=(in_axis, None))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxpr = jax.make_jaxpr(f)(xin, w)
        out = f(xin, w)
        jit_out = jax.jit(f)(xin, w)
    names = _primitives_in(jaxpr)
    assert many.name in names and one.name not in names
    eqn = next(e for e in jaxpr.jaxpr.eqns if e.primitive is many)
    assert eqn.invars[0].aval.shape == (5, 3)
    assert eqn.invars[1].aval.shape == (3, 4)
    expected = jax.vmap(_impl, (0, None))(xb, w)
    _close(out, expected)
    _close(jit_out, expected)


def test_vmap_with_counterpart_derivatives():
    one, _ = _pair("vmapgrad")
    xb, w = _operands(batch=5)
    loss = lambda f: lambda w: jnp.sum(jax.vmap(f, (0, None))(xb, w) ** 2)
    per_sample = lambda f: jax.vmap(
        jax.grad(lambda x, w: jnp.sum(f(x, w))), (0, None))(xb, w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = jax.jit(jax.grad(loss(one)))(w)
        per = jax.jit(lambda: per_sample(one))()  # vmap of grad
    _close(got, jax.jit(jax.grad(loss(_impl)))(w))
    _close(per, jax.jit(lambda: per_sample(_impl))())


def test_vmap_without_counterpart_warns_and_is_correct():
    name = _name("vmapnc")
    p = register_primitive(name, _impl)
    xb, w = _operands(batch=5)
    with pytest.warns(UserWarning, match=re.escape(name)):
        out = jax.vmap(p, (1, None))(xb.T, w)
    _close(out, jax.vmap(_impl, (0, None))(xb, w))


def test_vmap_over_weight_falls_back_even_with_counterpart():
    one, many = _pair("vmapw")
    x, w = _operands()
    ws = jnp.stack([w, -w, 2 * w])
    with pytest.warns(UserWarning, match=re.escape(one.name)):
        jaxpr = jax.make_jaxpr(jax.vmap(one, (None, 0)))(x, ws)
    names = _primitives_in(jaxpr)
    assert one.name not in names and many.name not in names
    with pytest.warns(UserWarning, match=re.escape(one.name)):
        out = jax.vmap(one, (None, 0))(x, ws)
    _close(out, jax.vmap(_impl, (None, 0))(x, ws))


def test_register_batched_counterpart_checks():
    one = register_primitive(_name("chk"), _impl)
    other_x = register_primitive(_name("chk_b"), lambda w, x: x @ w, x_invar_index=1,
                                 trainable_invars_fn=lambda p: {"weight": 0})
    with pytest.raises(ValueError, match="same operand position"):
        register_batched_counterpart(one, other_x)
    with pytest.raises(TypeError, match="ETPPrimitive"):
        register_batched_counterpart(one, jax.extend.core.Primitive("plain"))


# -- multiple outputs ------------------------------------------------------------------


def _two_outputs(x, w):
    return jnp.sum(x**2), jnp.tanh(x @ w)


def test_multiple_outputs_with_y_outvar_index():
    name = _name("multi")
    p = register_primitive(name, _two_outputs, y_outvar_index=1)
    assert p.y_outvar_index == 1
    x, w = _operands()
    want = _two_outputs(x, w)
    for got in (p(x, w), jax.jit(p)(x, w)):
        assert isinstance(got, tuple) and len(got) == 2
        for g, e in zip(got, want, strict=True):
            _close(g, e)
    jaxpr = jax.make_jaxpr(p)(x, w)
    eqn = jaxpr.jaxpr.eqns[0]
    assert eqn.primitive is p and len(eqn.outvars) == 2
    assert eqn.outvars[p.y_outvar_index].aval.shape == (4,)
    loss = lambda f: lambda x, w: f(x, w)[0] + jnp.sum(f(x, w)[1] ** 2)
    got = jax.grad(loss(p), argnums=(0, 1))(x, w)
    exp = jax.grad(loss(_two_outputs), argnums=(0, 1))(x, w)
    for g, e in zip(got, exp, strict=True):
        _close(g, e)


def test_multiple_outputs_vmap_with_counterpart():
    one = register_primitive(_name("multi1"), _two_outputs, y_outvar_index=1)
    many = register_primitive(_name("multiB"), jax.vmap(_two_outputs, (0, None)),
                              batched=True, y_outvar_index=1)
    register_batched_counterpart(one, many)
    xb, w = _operands(batch=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s, y = jax.vmap(one, (0, None))(xb, w)
        jaxpr = jax.make_jaxpr(jax.vmap(one, (0, None)))(xb, w)
    s0, y0 = jax.vmap(_two_outputs, (0, None))(xb, w)
    _close(s, s0)
    _close(y, y0)
    assert many.name in _primitives_in(jaxpr)


# -- ETP rules ---------------------------------------------------------------------------


def test_rule_registration_and_lookup():
    p = register_primitive(_name("rules"), _impl)
    assert not any(p.has_rule(r) for r in ("dt_to_t", "xy_to_dw", "init_drtrl", "init_pp"))

    @p.register_dt_to_t
    def dt_to_t(d, trace):
        return trace

    assert p.rule("dt_to_t") is dt_to_t
    xy, init_d, init_p = (lambda *a: 1), (lambda *a: 2), (lambda *a: 3)
    p.register_etp_rules(xy_to_dw=xy, init_drtrl=init_d)
    assert p.rule("xy_to_dw") is xy and p.rule("init_drtrl") is init_d
    assert p.rule("dt_to_t") is dt_to_t  # None leaves a rule unchanged
    assert p.register_init_pp(init_p) is init_p and p.has_rule("init_pp")
    p.register_trace_space_rules(xy_to_trace=xy, trace_to_dw=init_p)
    assert p.rule("xy_to_trace") is xy and p.rule("trace_to_dw") is init_p
    assert braintrace.etp_primitives()[p.name] is p


def test_missing_rule_error_names_primitive_and_rule():
    name = _name("missing")
    p = register_primitive(name, _impl)
    p.register_xy_to_dw(lambda x, d, theta: {})
    with pytest.raises(MissingRuleError, match=rf"{re.escape(name)}.*'dt_to_t'"):
        p.rule("dt_to_t")
    with pytest.raises(MissingRuleError, match="init_pp"):
        p.rule("init_pp")
    assert issubclass(MissingRuleError, LookupError)
    with pytest.raises(ValueError, match="Unknown ETP rule 'dt_to_T'"):
        p.rule("dt_to_T")


def test_non_callable_rules_are_rejected():
    name = _name("noncallable")
    p = register_primitive(name, _impl)
    with pytest.raises(TypeError, match=rf"{re.escape(name)}.*'dt_to_t' must be callable"):
        p.register_etp_rules(dt_to_t=3.0)
    with pytest.raises(TypeError, match="'init_pp' must be callable"):
        p.register_init_pp("zeros")
    with pytest.raises(TypeError, match="'trace_to_dw' must be callable"):
        p.register_trace_space_rules(xy_to_trace=lambda *a: 0, trace_to_dw=None)
    assert not p.has_rule("dt_to_t") and not p.has_rule("init_pp")


# -- registration errors ----------------------------------------------------------------


def test_non_callable_impl():
    with pytest.raises(TypeError, match="impl_fn must be callable"):
        register_primitive(_name("badimpl"), "x @ w")
    with pytest.raises(TypeError, match="trainable_invars_fn must be callable"):
        register_primitive(_name("badlayout"), _impl, trainable_invars_fn={"weight": 1})


def test_negative_indices():
    with pytest.raises(ValueError, match="x_invar_index"):
        register_primitive(_name("negx"), _impl, x_invar_index=-1)
    with pytest.raises(ValueError, match="y_outvar_index"):
        register_primitive(_name("negy"), _impl, y_outvar_index=-1)


# -- layout: an ordinary op everywhere, checked when compiled ----------------------------


def _decay(w):
    return jnp.exp(-w)


def _scale(x, w):
    return x * w


def _sum_and_scale(x, w):
    return jnp.sum(x), x * w


def _behaves_like_impl(name, f, g, *operands):
    """Binding, jit, grad, jvp and vmap of ``f`` (using the primitive) equal those of ``g``."""
    loss = lambda h: lambda *o: jnp.sum(jnp.sin(h(*o)))
    argnums = tuple(range(len(operands)))
    _close(f(*operands), g(*operands))
    _close(jax.jit(f)(*operands), g(*operands))
    for got, want in zip(jax.jit(jax.grad(loss(f), argnums))(*operands),
                         jax.grad(loss(g), argnums)(*operands), strict=True):
        _close(got, want)
    tangents = tuple(jnp.ones_like(o) for o in operands)
    _close(jax.jvp(f, operands, tangents)[1], jax.jvp(g, operands, tangents)[1])
    stacked = tuple(jnp.stack([o, 2 * o]) for o in operands)
    with pytest.warns(UserWarning, match=re.escape(name)):  # the documented fallback
        _close(jax.vmap(f)(*stacked), jax.vmap(g)(*stacked))


def test_no_input_primitive_defaults_to_weight_operand_zero():
    # The example: no trainable_invars_fn, no x. It used to fail at bind.
    name = _name("noinput_default")
    p = register_primitive(name, lambda w: jnp.exp(-w), gradient_enabled=True,
                           x_invar_index=None)
    assert p.trainable_invars({}) == {"weight": 0}
    w = jnp.array([0.5, 1.0, 2.0])
    _behaves_like_impl(name, p, _decay, w)
    _close(jax.grad(lambda w: jnp.sum(p(w)))(w), -jnp.exp(-w))
    eqn = jax.make_jaxpr(p)(w).jaxpr.eqns[0]
    p.check_layout(eqn)

    def step(params, hidden, x):
        h = p(params["w"]) * hidden["h"] + x
        return {"h": h}, h

    graph = braintrace.compile_graph(step, jnp.ones(3), params={"w": w},
                                     hidden={"h": jnp.zeros(3)})
    assert graph.traced_param_paths == ("w",)


# tag: (impl, register_primitive keywords, what the error message must say)
_BAD_LAYOUTS = {
    "weight_past_operands": (
        _decay, {"x_invar_index": None, "gradient_enabled": True,
                 "trainable_invars_fn": lambda params: {"weight": 1}},
        r"trainable input 'weight' has index 1, outside the 1 operand"),
    "kernel_past_operands": (
        _scale, {"trainable_invars_fn": lambda params: {"kernel": 2}},
        r"trainable input 'kernel' has index 2, outside the 2 operand"),
    "negative_index": (
        _scale, {"trainable_invars_fn": lambda params: {"kernel": -1}},
        r"trainable input 'kernel' has index -1, outside the 2 operand"),
    "kernel_is_x": (
        _scale, {"trainable_invars_fn": lambda params: {"kernel": 0}},
        r"trainable input 'kernel' has index 0, which is the input x \(x_invar_index=0\)"),
    "x_past_operands": (
        _scale, {"x_invar_index": 2}, r"x_invar_index=2 is outside the 2 operand"),
    "y_past_outputs": (
        _scale, {"y_outvar_index": 1}, r"y_outvar_index=1 is outside the 1 output"),
    "y_past_two_outputs": (
        _sum_and_scale, {"y_outvar_index": 2}, r"y_outvar_index=2 is outside the 2 output"),
}


def _bad(tag):
    impl, keywords, message = _BAD_LAYOUTS[tag]
    return register_primitive(_name(tag), impl, **keywords), impl, message


@pytest.mark.parametrize("tag", sorted(_BAD_LAYOUTS))
def test_any_layout_binds_and_differentiates_like_its_impl(tag):
    p, impl, _ = _bad(tag)
    if p.x_invar_index is None:
        _behaves_like_impl(p.name, p, impl, jnp.array([0.5, 1.0, 2.0]))
    elif isinstance(p(jnp.ones(3), jnp.ones(3)), tuple):
        _behaves_like_impl(p.name, lambda x, w: p(x, w)[1], lambda x, w: impl(x, w)[1],
                           jnp.array([1.0, -2.0, 3.0]), jnp.array([0.5, 0.25, -1.0]))
    else:
        _behaves_like_impl(p.name, p, impl, jnp.array([1.0, -2.0, 3.0]),
                           jnp.array([0.5, 0.25, -1.0]))


@pytest.mark.parametrize("tag", sorted(_BAD_LAYOUTS))
def test_check_layout_names_primitive_key_and_index(tag):
    p, _, message = _bad(tag)
    operands = (jnp.ones(3),) if p.x_invar_index is None else (jnp.ones(3), jnp.ones(3))
    eqn = jax.make_jaxpr(p)(*operands).jaxpr.eqns[0]
    with pytest.raises(ValueError, match=rf"ETP primitive '{re.escape(p.name)}': {message}"):
        p.check_layout(eqn)


@pytest.mark.parametrize("tag", sorted(_BAD_LAYOUTS))
def test_compiling_a_bad_layout_is_a_clear_error(tag):
    p, _, message = _bad(tag)

    def step(params, hidden, x):
        if p.x_invar_index is None:
            y = p(params["w"])
        else:
            y = p(x, params["w"])
        y = y[1] if p.multiple_results else y
        h = 0.9 * hidden["h"] + y
        return {"h": h}, h

    with pytest.raises(ValueError, match=rf"^step: ETP primitive '{re.escape(p.name)}': "
                                         rf"{message}.*\. (Register|Fix) "):
        braintrace.compile_graph(step, jnp.ones(3), params={"w": jnp.ones(3)},
                                 hidden={"h": jnp.zeros(3)})


def test_compiling_a_module_with_a_bad_layout_names_the_module():
    from flax import nnx

    p, _, message = _bad("kernel_past_operands")

    class Leaky(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(3))
            self.h = braintrace.HiddenState(jnp.zeros((2, 3)))

        def __call__(self, x):
            self.h[...] = 0.9 * self.h[...] + p(x, self.w[...])
            return self.h[...]

    with pytest.raises(ValueError, match=rf"^Leaky: ETP primitive '{re.escape(p.name)}': "
                                         rf"{message}"):
        braintrace.compile(Leaky(), "d_rtrl", jnp.ones((2, 3)))


def test_built_in_layouts_pass_the_check():
    x, k, b = jnp.ones((2, 3)), jnp.ones((3, 4)), jnp.ones(4)
    closed = jax.make_jaxpr(lambda x, k, b, tau: (
        braintrace.matmul(x, k, b),
        braintrace.lora_matmul(x, jnp.ones((3, 2)), jnp.zeros((2, 4)), b),
        braintrace.element_wise(tau, jnp.exp)))(x, k, b, jnp.ones(4))
    etp = [e for e in closed.jaxpr.eqns if isinstance(e.primitive, braintrace.ETPPrimitive)]
    assert len(etp) == 3
    for eqn in etp:
        eqn.primitive.check_layout(eqn)


def test_vmap_falls_back_when_x_index_names_no_operand():
    name = _name("vmap_badx")
    impl = lambda x, w: x * w
    one = register_primitive(name, impl, x_invar_index=2)
    many = register_primitive(_name("vmap_badx_b"), impl, x_invar_index=2, batched=True)
    register_batched_counterpart(one, many)
    xs, w = jnp.arange(6.0).reshape(2, 3), jnp.ones(3)
    with pytest.warns(UserWarning, match=re.escape(name)):
        jaxpr = jax.make_jaxpr(jax.vmap(one, (0, None)))(xs, w)
    assert one.name not in _primitives_in(jaxpr) and many.name not in _primitives_in(jaxpr)
    with pytest.warns(UserWarning, match=re.escape(name)):
        _close(jax.vmap(one, (0, None))(xs, w), xs * w)
