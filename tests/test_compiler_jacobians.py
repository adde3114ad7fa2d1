"""``D`` and ``Df`` of the compiled graph against ``jax.jacobian`` oracles (float64).

* ``D`` oracle: the full Jacobian of the hidden outputs with respect to the
  hidden inputs, with every ETP output held constant (the cut step); ``D`` must
  be its per-position diagonal blocks. Where the true step is
  position-diagonal (leaky integrators, LIF, ALIF) the oracle is the
  Jacobian of the real step, with nothing held constant. For the GRU and the
  LSTM the cut step is written by hand from the cell equations.
* ``Df`` oracle: the Jacobian of the hidden outputs with respect to the output
  ``y`` of the ETP equation (an added zero input differentiated), read at
  ``[π(k), k]``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import braintrace
from braintrace import layers
from braintrace._compiler import StepLeaves, _jacobians, programs, split_model
from braintrace._compiler._interpret import evaluate

B, I, H = 2, 3, 4
TOL = 1e-6


class Leaky(nnx.Module):
    """Leaky integrator: learnable decay (elementwise) and input weights (dense)."""

    def __init__(self, rngs):
        self.tau = layers.ETPElemwise(jnp.linspace(1.0, 3.0, H), layers.ExpDecay(1.0),
                                      param_dtype=jnp.float64)
        self.inp = layers.ETPLinear(I, H, rngs=rngs, param_dtype=jnp.float64)
        self.h = braintrace.HiddenState(jnp.zeros(H, jnp.float64))

    def __call__(self, x):
        self.h[...] = self.tau() * jnp.tanh(self.h[...]) + self.inp(x)
        return self.h[...]


class Roll(nnx.Module):
    """The step moves hidden values between positions (``roll``) and adds them back."""

    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (I, H), jnp.float64))
        self.h = braintrace.HiddenState(jnp.zeros(H, jnp.float64))

    def __call__(self, x):
        h = self.h[...]
        self.h[...] = 0.5 * jnp.roll(h, 1, axis=-1) * h + 0.3 * jnp.sin(h) \
            + braintrace.matmul(x, self.w[...])
        return self.h[...]


def make(name, rngs):
    f64 = {"param_dtype": jnp.float64}
    if name == "leaky":
        return Leaky(rngs)
    if name == "lif":
        return layers.LIF(H, learn_tau=True, tau=3.0, **f64)
    if name == "alif":
        return layers.ALIF(H, learn_tau=True, learn_tau_a=True, tau=3.0, tau_a=5.0, **f64)
    if name == "lstm":
        return layers.Stateful(layers.LSTMCell(I, H, rngs=rngs, **f64))
    if name == "gru":
        return layers.Stateful(layers.GRUCell(I, H, rngs=rngs, **f64))
    if name == "roll":
        return Roll(rngs)
    if name == "dense-alif":  # two coupled states fed by a dense layer, no elementwise relation
        return nnx.Sequential(layers.ETPLinear(I, H, rngs=rngs, **f64),
                              layers.ALIF(H, tau=3.0, tau_a=5.0, **f64))
    if name == "two-layer":  # two groups: an ALIF layer (2 states) into a LIF layer (1)
        return nnx.Sequential(layers.ETPLinear(I, H, rngs=rngs, **f64),
                              layers.ALIF(H, learn_tau=True, tau=3.0, tau_a=5.0, **f64),
                              layers.ETPLinear(H, 3, rngs=rngs, **f64),
                              layers.LIF(3, learn_tau=True, tau=4.0, **f64))
    raise AssertionError(name)


@functools.cache
def setup(name):
    """A compiled graph with random hidden state, and its leaves (float64; cached)."""
    model = make(name, nnx.Rngs(0))
    braintrace.init_states(model, B)
    x_features = H if name in ("lif", "alif") else I
    keys = jax.random.split(jax.random.key(1), 8)
    x = jax.random.normal(keys[0], (B, x_features), jnp.float64)
    graph = braintrace.compile_graph(model, x)
    _, params, hidden, other = split_model(model)
    P, O = jax.tree.leaves(params), jax.tree.leaves(other)
    # States near the spike threshold so the surrogate derivative matters.
    Hs = [0.6 + 0.5 * jax.random.normal(k, h.shape, jnp.float64)
          for k, h in zip(keys[1:], jax.tree.leaves(hidden))]
    return model, graph, P, Hs, O, [x]


def hidden_out(graph, outs):
    start = graph.num_outputs + graph.num_params
    return outs[start:start + graph.num_hidden]


def cut_step(graph, P, O, X, cut_etp):
    """``hidden_in -> hidden_out`` of the graph's jaxpr, ETP outputs held constant or not."""
    stop = frozenset(e for e in graph.etp_eqns
                     if not graph.jaxpr.eqns[e].primitive.gradient_enabled) if cut_etp \
        else frozenset()

    def f(hs):
        outs, _ = evaluate(graph.jaxpr, graph.consts, [*P, *hs, *O, *X], stop_eqns=stop)
        return hidden_out(graph, outs)

    return f


def diagonal_blocks(jac, group):
    """``(*V, S, S)`` per-position blocks of the full Jacobian ``jac[out][in]``."""
    n = group.size
    rows = []
    for s in group.leaves:
        rows.append(jnp.stack([jnp.diagonal(jac[s][s2].reshape(n, n)) for s2 in group.leaves],
                              axis=-1))
    return jnp.stack(rows, axis=-2).reshape(*group.shape, group.num_states, group.num_states)


def real_step(model, x):
    """``hidden_in -> hidden_out`` of the model itself (NNX merge and call)."""
    graphdef, params, hidden, other = split_model(model)

    def f(hs):
        state = jax.tree.unflatten(jax.tree.structure(hidden), hs)
        m = nnx.merge(graphdef, params, state, other, copy=True)
        m(x)
        return jax.tree.leaves(split_model(m)[2])

    return f


@pytest.mark.parametrize("name", ["leaky", "lif", "alif", "lstm", "gru", "roll", "two-layer"])
def test_d_equals_diagonal_blocks_of_the_cut_step_jacobian(name):
    with jax.enable_x64(True):
        _, graph, P, Hs, O, X = setup(name)
        D, _ = jax.jit(lambda *a: programs.jacobians(graph, StepLeaves(*a)))(P, Hs, O, X)
        jac = jax.jit(jax.jacobian(cut_step(graph, P, O, X, cut_etp=True)))(Hs)
        assert len(D) == len(graph.groups)
        for g, d in zip(graph.groups, D):
            want = diagonal_blocks(jac, g)
            assert d.shape == (*g.shape, g.num_states, g.num_states)
            np.testing.assert_allclose(d, want, atol=TOL, rtol=TOL)
            assert float(jnp.max(jnp.abs(want))) > 1e-3  # a live oracle


@pytest.mark.parametrize("name", ["leaky", "lif", "alif"])
def test_d_equals_jacobian_of_the_real_position_diagonal_step(name):
    with jax.enable_x64(True):
        model, graph, P, Hs, O, X = setup(name)
        D, _ = jax.jit(lambda *a: programs.jacobians(graph, StepLeaves(*a)))(P, Hs, O, X)
        jac = jax.jit(jax.jacobian(real_step(model, X[0])))(Hs)
        (g,) = graph.groups
        np.testing.assert_allclose(D[0], diagonal_blocks(jac, g), atol=TOL, rtol=TOL)
        # The step is position-diagonal: all off-diagonal entries are zero.
        full = sum(float(jnp.sum(jnp.abs(jac[s][s2]))) for s in g.leaves for s2 in g.leaves)
        diag = float(jnp.sum(jnp.abs(diagonal_blocks(jac, g))))
        assert full == pytest.approx(diag)


def test_alif_d_has_both_states_coupled():
    with jax.enable_x64(True):
        _, graph, P, Hs, O, X = setup("alif")
        (g,) = graph.groups
        assert g.paths == ("a", "v") and g.num_states == 2
        D, _ = programs.jacobians(graph, StepLeaves(P, Hs, O, X))
        # a depends on v through the spike (surrogate) and v on a through the threshold.
        assert float(jnp.max(jnp.abs(D[0][..., 0, 1]))) > 1e-3
        assert float(jnp.max(jnp.abs(D[0][..., 1, 0]))) > 1e-3


def df_oracle(graph, relation, P, Hs, O, X):
    """``∂h_g/∂y`` of the relation's equation, by an injected zero input."""
    eqn = graph.jaxpr.eqns[relation.eqn_index]
    position = eqn.primitive.y_outvar_index
    y_aval = eqn.outvars[position].aval
    group = graph.groups[relation.group]

    def f(inj):
        outs, _ = evaluate(graph.jaxpr, graph.consts, [*P, *Hs, *O, *X],
                           injections={relation.eqn_index: (position, inj)})
        hs = hidden_out(graph, outs)
        return jnp.stack([hs[k] for k in group.leaves], axis=-1)  # (*V, S)

    jac = jax.jit(jax.jacobian(f))(jnp.zeros(y_aval.shape, y_aval.dtype))  # (*V, S, *y)
    n, y_size = group.size, int(np.prod(y_aval.shape))
    return jac.reshape(n, group.num_states, y_size), group


@pytest.mark.parametrize("name", ["leaky", "lif", "alif", "lstm", "gru", "two-layer"])
def test_df_equals_jacobian_with_respect_to_the_etp_output(name):
    with jax.enable_x64(True):
        _, graph, P, Hs, O, X = setup(name)
        _, Df = jax.jit(lambda *a: programs.jacobians(graph, StepLeaves(*a)))(P, Hs, O, X)
        assert len(Df) == len(graph.relations) > 0
        for r, df in zip(graph.relations, Df):
            jac, g = df_oracle(graph, r, P, Hs, O, X)
            if r.has_input:
                # Entry [k, s] is ∂h[π(k), s]/∂y[k]; every other entry of the oracle is 0.
                k = np.arange(jac.shape[-1])
                pi = r.y_to_hidden
                assert (pi >= 0).all()
                want = jac[pi, :, k]  # (y_size, S)
                np.testing.assert_allclose(df.reshape(-1, g.num_states), want, atol=TOL)
                mask = np.zeros(jac.shape, bool)
                mask[pi, :, k] = True
                assert float(jnp.max(jnp.abs(jnp.where(mask, 0, jac)))) == 0.0
            else:
                # Entry [v, s] is ∂h[v, s]/∂y[σ(v)].
                sigma = r.hidden_to_y
                want = jac[np.arange(g.size), :, sigma]
                np.testing.assert_allclose(df.reshape(g.size, g.num_states), want, atol=TOL)
            assert float(jnp.max(jnp.abs(df))) > 1e-3


def test_gru_fused_kernel_against_hand_written_cut_step():
    """D and Df of ``nnx``-style GRU (fused ``(in, 3h)`` kernel) from the cell equations."""
    with jax.enable_x64(True):
        model, graph, P, Hs, O, X = setup("gru")
        cell = model.cell
        wi, bi, wh = cell.dense_i.kernel[...], cell.dense_i.bias[...], cell.dense_h.kernel[...]
        (h,), (x,) = Hs, X
        yi, yh = x @ wi + bi, h @ wh  # the two ETP outputs

        def step(h, yi, yh):
            xr, xz, xn = jnp.split(yi, 3, axis=-1)
            hr, hz, hn = jnp.split(yh, 3, axis=-1)
            r, z = jax.nn.sigmoid(xr + hr), jax.nn.sigmoid(xz + hz)
            n = jnp.tanh(xn + r * hn)
            return (1 - z) * n + z * h

        D, Df = programs.jacobians(graph, StepLeaves(P, Hs, O, X))
        d_want = jnp.diagonal(jax.jacobian(step)(h, yi, yh).reshape(B * H, B * H))
        np.testing.assert_allclose(D[0].reshape(-1), d_want, atol=TOL)
        rel = {r.param_paths["kernel"][0]: (r, df) for r, df in zip(graph.relations, Df)}
        for path, argnum, y in (("cell.dense_i.kernel", 1, yi), ("cell.dense_h.kernel", 2, yh)):
            r, df = rel[path]
            assert r.num_colours == 3 and df.shape == (B, 3 * H, 1)
            jac = jax.jacobian(step, argnums=argnum)(h, yi, yh)  # (B, H, B, 3H)
            b, j = np.meshgrid(np.arange(B), np.arange(3 * H), indexing="ij")
            want = jac[b, j % H, b, j]
            np.testing.assert_allclose(df[..., 0], want, atol=TOL)


def test_lstm_cell_and_hidden_group_against_hand_written_cut_step():
    with jax.enable_x64(True):
        model, graph, P, Hs, O, X = setup("lstm")
        cell = model.cell
        (x,) = X
        c, h = Hs
        lin = lambda m, v: v @ m.kernel[...] + (m.bias[...] if m.bias is not None else 0)
        gates = {n: lin(getattr(cell, f"i{n}" if n != "f" else "if_"), x)
                 + lin(getattr(cell, f"h{n}"), h) for n in ("i", "f", "g", "o")}

        def step(c, h):  # all ETP outputs (the gates' pre-activations) held constant
            i, f = jax.nn.sigmoid(gates["i"]), jax.nn.sigmoid(gates["f"])
            g, o = jnp.tanh(gates["g"]), jax.nn.sigmoid(gates["o"])
            new_c = f * c + i * g
            return new_c, o * jnp.tanh(new_c)

        (g,) = graph.groups
        assert g.paths == ("carry.0", "carry.1")
        D, _ = programs.jacobians(graph, StepLeaves(P, Hs, O, X))
        np.testing.assert_allclose(D[0], diagonal_blocks(jax.jacobian(step, (0, 1))(c, h), g),
                                   atol=TOL)
        # c' = f c + i g: ∂c'/∂c = f; nothing depends on h once the gates are fixed.
        np.testing.assert_allclose(D[0][..., 0, 0], jax.nn.sigmoid(gates["f"]), atol=TOL)
        assert float(jnp.max(jnp.abs(D[0][..., :, 1]))) == 0.0


def test_mixing_path_from_etp_output_is_cut_in_df_and_reported():
    """``h' = a h + y + sum(y)``: Df follows the structural path only (the sum is reported)."""

    class SumY(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((I, H), jnp.float64))
            self.h = braintrace.HiddenState(jnp.zeros(H, jnp.float64))

        def __call__(self, x):
            y = braintrace.matmul(x, self.w[...])
            self.h[...] = 0.5 * self.h[...] + 3.0 * y + jnp.sum(y, -1, keepdims=True)
            return self.h[...]

    with jax.enable_x64(True):
        model = SumY()
        braintrace.init_states(model, B)
        x = jnp.ones((B, I), jnp.float64)
        graph = braintrace.compile_graph(model, x)
        _, params, hidden, other = split_model(model)
        _, Df = programs.jacobians(graph, StepLeaves(
            jax.tree.leaves(params), jax.tree.leaves(hidden), jax.tree.leaves(other), [x]))
        np.testing.assert_allclose(Df[0], 3.0)
        (approx,) = graph.approximations
        assert approx.kind == "output-mixing" and approx.param_paths == ("w",)
        assert "reduce_sum" in approx.detail


def test_position_moving_step_is_coloured_and_reported_as_an_approximation():
    with jax.enable_x64(True):
        _, graph, *_ = setup("roll")
        (g,) = graph.groups
        assert g.num_colours > 1
        assert "moved-positions" in {a.kind for a in graph.approximations}
    with jax.enable_x64(True):
        _, graph, *_ = setup("leaky")
        assert graph.groups[0].colours is None
        assert graph.warnings == () and graph.approximations == ()


def test_fixed_recurrent_matrix_is_cut_in_diagonal_scope_and_kept_in_coupled_scope():
    class FixedRecurrent(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((I, H), jnp.float64))
            self.m = nnx.Variable(jax.random.normal(jax.random.key(2), (H, H), jnp.float64))
            self.h = braintrace.HiddenState(jnp.zeros(H, jnp.float64))

        def __call__(self, x):
            self.h[...] = jnp.tanh(self.h[...] @ self.m[...] + braintrace.matmul(x, self.w[...]))
            return self.h[...]

    with jax.enable_x64(True):
        model = FixedRecurrent()
        braintrace.init_states(model, B)
        x = jax.random.normal(jax.random.key(3), (B, I), jnp.float64)
        Hs = [jax.random.normal(jax.random.key(4), (B, H), jnp.float64)]
        _, params, _, other = split_model(model)
        P, O = jax.tree.leaves(params), jax.tree.leaves(other)
        coupled = braintrace.compile_graph(model, x, scope="coupled")
        (d,) = programs.coupled_jacobians(coupled, StepLeaves(P, Hs, O, [x]))
        jac = jax.jacobian(cut_step(coupled, P, O, [x], cut_etp=True))(Hs)
        want = diagonal_blocks(jac, coupled.groups[0])
        np.testing.assert_allclose(d, want, atol=TOL)
        assert float(jnp.min(jnp.abs(want))) > 0
        diagonal = braintrace.compile_graph(model, x)
        (d,), _ = programs.jacobians(diagonal, StepLeaves(P, Hs, O, [x]))
        np.testing.assert_allclose(d, 0.0)
        (approx,) = diagonal.approximations
        assert approx.kind == "hidden-coupling" and "dot_general" in approx.detail


def _by_jvp(graph, leaves):
    """``D`` and ``Df`` from one JVP per state and colour (the general path)."""
    return programs.assemble_jacobians(graph, programs.jacobian_responses(graph, leaves))


@pytest.mark.parametrize("name", ["dense-alif", "lstm", "gru"])
def test_pullbacks_give_the_d_and_df_of_one_jvp_per_state_and_colour(name):
    """Where no group moves positions and no elementwise output is shared, one pullback per
    state gives the JVPs' ``D`` and ``Df`` (two coupled states; the LSTM; the GRU's fused
    gates); ``jacobians`` takes them where a relation has several colours (the GRU)."""
    with jax.enable_x64(True):
        _, graph, P, Hs, O, X = setup(name)
        assert programs.can_pull_jacobians(graph)
        fused = any(r.num_colours > 1 for r in graph.relations)
        assert programs.pulls_jacobians(graph) == fused
        assert fused == (name == "gru")  # its (in, 3h) kernel: three gates per unit
        pulled = jax.jit(lambda *a: _jacobians._pulled_jacobians(graph, StepLeaves(*a)))(
            P, Hs, O, X)
        by_jvp = jax.jit(lambda *a: _by_jvp(graph, StepLeaves(*a)))(P, Hs, O, X)
        taken = jax.jit(lambda *a: programs.jacobians(graph, StepLeaves(*a)))(P, Hs, O, X)
        assert jax.tree.structure(pulled) == jax.tree.structure(by_jvp)
        for got, want in zip(jax.tree.leaves(pulled), jax.tree.leaves(by_jvp)):
            assert got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
        for got, want in zip(jax.tree.leaves(taken), jax.tree.leaves(pulled if fused else by_jvp)):
            np.testing.assert_array_equal(got, want)
        assert all(float(jnp.max(jnp.abs(a))) > 1e-3 for a in jax.tree.leaves(by_jvp))


@pytest.mark.parametrize("name", ["leaky", "lif", "alif"])
def test_an_elementwise_output_shared_over_the_batch_keeps_one_jvp(name):
    """A learnable decay ``(H,)`` feeds every sample's unit: a pullback would sum its
    derivative over the batch, where ``Df`` keeps one per unit."""
    with jax.enable_x64(True):
        _, graph, P, Hs, O, X = setup(name)
        assert not programs.can_pull_jacobians(graph)
        run = lambda f: jax.jit(lambda *a: f(graph, StepLeaves(*a)))(P, Hs, O, X)
        got, want = run(programs.jacobians), run(_by_jvp)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(a, b)
        _, df_pulled = run(_jacobians._pulled_jacobians)  # negative control
        r = next(r for r in graph.relations if r.y_shape != graph.groups[r.group].shape)
        assert df_pulled[r.index].shape != want[1][r.index].shape or float(
            jnp.max(jnp.abs(df_pulled[r.index] - want[1][r.index]))) > 1e-3


def test_a_step_that_moves_positions_keeps_one_jvp_per_colour():
    """With a roll a pullback would sum ``∂h[v]/∂h[u]`` over the positions ``v`` that ``u``
    reaches, not the diagonal ``D`` keeps: such graphs keep the coloured JVPs."""
    with jax.enable_x64(True):
        _, graph, P, Hs, O, X = setup("roll")
        assert not programs.can_pull_jacobians(graph)
        run = lambda f: jax.jit(lambda *a: f(graph, StepLeaves(*a)))(P, Hs, O, X)
        (d,), _ = run(programs.jacobians)
        (d_jvp,), _ = run(_by_jvp)
        np.testing.assert_array_equal(d, d_jvp)
        (d_pulled,), _ = run(_jacobians._pulled_jacobians)  # negative control
        assert float(jnp.max(jnp.abs(d_pulled - d))) > 1e-2


def test_each_group_takes_its_own_tangents_and_an_unread_df_none():
    """Two groups (an ALIF layer, a LIF layer): each leaf holds its responses to its own
    group's slots only (fewer than all slots), and a relation whose ``Df`` no rule reads gets
    no tangent and ``None``, the rest unchanged (the oracle tests above check the values)."""
    with jax.enable_x64(True):
        _, graph, P, Hs, O, X = setup("two-layer")
        assert len(graph.groups) == 2
        leaves = StepLeaves(P, Hs, O, X)
        outs = programs.jacobian_responses(graph, leaves)
        slots = _jacobians._slots(graph)
        for g in graph.groups:
            own = _jacobians._group_slots(graph, g)
            assert all(outs[k].shape[0] == len(own) < len(slots) for k in g.leaves)
        d, df = programs.jacobians(graph, leaves)
        skip = next(r for r in graph.relations if r.has_input and r.group == 0)
        d_skip, df_skip = programs.jacobians(graph, leaves, frozenset({skip.index}))
        outs_skip = programs.jacobian_responses(graph, leaves, frozenset({skip.index}))
        assert df_skip[skip.index] is None and df[skip.index] is not None
        assert outs_skip[graph.groups[0].leaves[0]].shape[0] == outs[
            graph.groups[0].leaves[0]].shape[0] - skip.num_colours
        for got, want in zip(jax.tree.leaves((d_skip, df_skip)),
                             jax.tree.leaves((d, [f for r, f in zip(graph.relations, df)
                                                  if r.index != skip.index]))):
            np.testing.assert_array_equal(got, want)
