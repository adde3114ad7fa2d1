"""The 0.2.8 side of ``published.py``: its models, the weight mapping and its passes.

Imported only by the child that ``published.py`` starts in the Python 3.12 environment holding
``braintrace==0.2.8`` (``import braintrace`` here is 0.2.8, not this repository). The models are
``_models.py``'s GRU and SNN written to our equations from ``braintrace.nn.Linear`` (see
``published.py``'s docstring for the mapping and its one difference).
"""

from __future__ import annotations

import sys
import warnings

import brainstate
import braintools
import jax
import jax.numpy as jnp
import numpy as np

import braintrace as bt

if getattr(bt, "__version__", None) != "0.2.8":
    raise SystemExit(f"--published-python has braintrace {getattr(bt, '__version__', '?')}, "
                     "not 0.2.8")

lin, alpha = bt.nn.Linear, float(np.exp(-1.0 / 20.0))


class FastSigmoid(braintools.surrogate.Surrogate):
    """Our ``fast_sigmoid`` surrogate: ``H(x)`` forward, ``1 / (1 + 10 |x|)^2`` backward."""

    def surrogate_grad(self, x):
        return 1.0 / (1.0 + 10.0 * jnp.abs(x)) ** 2


spike = FastSigmoid()


class Hidden(brainstate.nn.Module):
    """A module with one hidden state ``s`` of ``size`` per sample, zero at the start."""

    def __init__(self, size):
        super().__init__()
        self.size = size

    def init_state(self, batch_size=None, **kwargs):
        self.s = brainstate.HiddenState(jnp.zeros((batch_size, self.size)))


class GRU(Hidden):
    """Our ``GRUNet``: gates split, ``W_r = [W_ir; W_hr]``, ``W_z = [W_iz; W_hz]``."""

    def __init__(self, i, h, o):
        super().__init__(h)
        self.Wr, self.Wz = lin(i + h, h), lin(i + h, h)
        self.Win, self.Whn, self.readout = lin(i, h), lin(h, h, b_init=None), lin(h, o)

    def update(self, x):
        h = self.s.value
        xh = jnp.concatenate([x, h], -1)
        r, z = jax.nn.sigmoid(self.Wr(xh)), jax.nn.sigmoid(self.Wz(xh))
        h = (1 - z) * jnp.tanh(self.Win(x) + r * self.Whn(h)) + z * h
        self.s.value = h
        return self.readout(h)


class LIF(Hidden):
    """Our ``RecurrentSpiking(LIF)``: ``W = [W_i; W_h]`` on ``[x_t, z_{t-1}]``, soft reset."""

    def __init__(self, i, h):
        super().__init__(h)
        self.W = lin(i + h, h)

    def update(self, x):
        z = spike(self.s.value - 1.0)
        v = alpha * (self.s.value - z) + self.W(jnp.concatenate([x, z], -1))
        self.s.value = v
        return spike(v - 1.0)


class Readout(Hidden):
    """Our ``LeakyReadout``: ``y_t = α y_{t-1} + W z_t + b``."""

    def __init__(self, i, o):
        super().__init__(o)
        self.W = lin(i, o)

    def update(self, z):
        self.s.value = alpha * self.s.value + self.W(z)
        return self.s.value


class SNN(brainstate.nn.Module):
    """Our ``SNN``: two LIF layers and the leaky readout."""

    def __init__(self, i, h, o):
        super().__init__()
        self.l1, self.l2, self.readout = LIF(i, h), LIF(h, h), Readout(h, o)

    def update(self, x):
        return self.readout(self.l2(self.l1(x)))


MODELS = {"gru": GRU, "snn": SNN}


def _gru_blocks(w: dict, h: int) -> dict:
    """0.2.8's GRU Params (name -> {'weight', 'bias'}) from ours (dotted path -> array)."""
    ki, bi = w["rnn.cell.dense_i.kernel"], w["rnn.cell.dense_i.bias"]
    kh = w["rnn.cell.dense_h.kernel"]
    gate = [slice(0, h), slice(h, 2 * h), slice(2 * h, 3 * h)]
    return {"Wr": {"weight": np.vstack([ki[:, gate[0]], kh[:, gate[0]]]), "bias": bi[gate[0]]},
            "Wz": {"weight": np.vstack([ki[:, gate[1]], kh[:, gate[1]]]), "bias": bi[gate[1]]},
            "Win": {"weight": ki[:, gate[2]], "bias": bi[gate[2]]},
            "Whn": {"weight": kh[:, gate[2]]},
            "readout": {"weight": w["readout.kernel"], "bias": w["readout.bias"]}}


def _gru_back(g: dict, i: int) -> dict:
    """Ours (dotted path -> array) from 0.2.8's GRU Params: the inverse of :func:`_gru_blocks`."""
    return {"rnn.cell.dense_i.kernel": np.hstack([g["Wr"]["weight"][:i], g["Wz"]["weight"][:i],
                                                  g["Win"]["weight"]]),
            "rnn.cell.dense_i.bias": np.concatenate([g["Wr"]["bias"], g["Wz"]["bias"],
                                                     g["Win"]["bias"]]),
            "rnn.cell.dense_h.kernel": np.hstack([g["Wr"]["weight"][i:], g["Wz"]["weight"][i:],
                                                  g["Whn"]["weight"]]),
            "readout.kernel": g["readout"]["weight"], "readout.bias": g["readout"]["bias"]}


def _snn_blocks(w: dict, h: int) -> dict:
    out = {f"{n}.W": {"weight": np.vstack([w[f"{n}.dense_i.kernel"], w[f"{n}.dense_h.kernel"]]),
                      "bias": w[f"{n}.dense_i.bias"]} for n in ("l1", "l2")}
    out["readout.W"] = {"weight": w["readout.linear.kernel"], "bias": w["readout.linear.bias"]}
    return out


def _snn_back(g: dict, i: int) -> dict:
    out = {"readout.linear.kernel": g["readout.W"]["weight"],
           "readout.linear.bias": g["readout.W"]["bias"]}
    for n, cut in (("l1", i), ("l2", g["l2.W"]["weight"].shape[1])):
        out.update({f"{n}.dense_i.kernel": g[f"{n}.W"]["weight"][:cut],
                    f"{n}.dense_h.kernel": g[f"{n}.W"]["weight"][cut:],
                    f"{n}.dense_i.bias": g[f"{n}.W"]["bias"]})
    return out


def _load_published_weights(model, name: str, weights: dict, hidden: int) -> dict:
    """Copies our weights into 0.2.8's Params by name, asserting every shape; returns the map."""
    blocks = (_gru_blocks if name == "gru" else _snn_blocks)(weights, hidden)
    states = model.states(brainstate.ParamState)
    paths = {".".join(map(str, k[:-1] if k[-1] == "weight" else k)): s for k, s in states.items()}
    if set(paths) != set(blocks):
        raise AssertionError(f"0.2.8's Params {sorted(paths)} do not map onto {sorted(blocks)}")
    for path, state in paths.items():
        have = {k: np.shape(v) for k, v in state.value.items()}
        want = {k: np.shape(v) for k, v in blocks[path].items()}
        if have != want:
            raise AssertionError(f"0.2.8's Param {path}: shapes {have}, ours map to {want}")
        state.value = {k: jnp.asarray(v) for k, v in blocks[path].items()}
    return paths


def _published_passes(make_model, xs, ys, batch: int) -> dict:
    """``method -> run``: 0.2.8's compiled passes over the sequence, one fresh model each
    (``make_model()``: built, weights copied), each from zero hidden state."""

    def from_zero(model, fn):
        def run(xs, ys):  # the states are looked up now: compile() replaces them
            for state in model.states(brainstate.HiddenState).values():
                state.value = jnp.zeros_like(state.value)
            return fn(xs, ys)
        return brainstate.transform.jit(run)

    passes = {}
    for method, alg, opts in (("pub:pp_prop", bt.pp_prop, {"decay_or_rank": 0.9}),
                              ("pub:d_rtrl", bt.D_RTRL, {})):
        model = make_model()
        learner = bt.compile(model, alg, xs[0], batch_size=batch, **opts)

        def step_loss(x, y, learner=learner):
            return jnp.mean((learner(x) - y) ** 2)

        passes[method] = from_zero(model, lambda xs, ys, learner=learner, f=step_loss:
                                   learner.etrace_grad(xs, ys, step_fn=f))
    model = make_model()
    brainstate.nn.init_all_states(model, batch)

    def total(xs, ys):
        step = brainstate.transform.for_loop(lambda x, y: jnp.mean((model(x) - y) ** 2), xs, ys)
        return step.mean()

    params = model.states(brainstate.ParamState)
    passes["pub:bptt"] = from_zero(model, brainstate.transform.grad(total, params))
    return {m: (lambda f=f: f(xs, ys)) for m, f in passes.items()}


def published_child(spec: dict, compile_passes) -> dict:
    """0.2.8's compiled passes (``compile_passes``: ``published._compile_passes``), first
    gradients mapped to our Param paths, zero Params in 0.2.8's names, versions."""
    warnings.simplefilter("ignore")  # 0.2.8's compiler notes the readout has no hidden state
    data = dict(np.load(spec["npz"]))
    cfg, name = spec["config"], spec["model"]
    weights = {k[2:]: v for k, v in data.items() if k.startswith("w:")}
    built = []

    def make_model():
        model = MODELS[name](cfg["inputs"], cfg["hidden"], cfg["outputs"])
        built.append(_load_published_weights(model, name, weights, cfg["hidden"]))
        return model

    xs, ys = jnp.asarray(data["xs"]), jnp.asarray(data["ys"])
    runs = _published_passes(make_model, xs, ys, cfg["batch"])
    paths = built[0]
    back = _gru_back if name == "gru" else _snn_back
    result = compile_passes(runs, jax.block_until_ready)
    for method in runs:
        blocks = {".".join(map(str, k[:-1])): {kk: np.asarray(vv) for kk, vv in v.items()}
                  for k, v in result["first"].pop(method).items()}
        if set(blocks) != set(paths):
            raise AssertionError(f"{method}: gradients of {sorted(blocks)}, Params {sorted(paths)}")
        result["zero"][method] = sorted(f"{k}.{kk}" for k, v in blocks.items()
                                        for kk, a in v.items() if not np.any(a))
        result["grads"][method] = back(blocks, cfg["inputs"])
    result["versions"] = {"braintrace": bt.__version__, "jax": jax.__version__,
                          "python": sys.version.split()[0]}
    return result
