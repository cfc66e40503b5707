"""The verdicts on a user's own layer (`mha-parity --impl`), through the command line.

Each test writes small attention layers into a module under tmp_path, puts it on sys.path
and runs `parity.cli.main` in-process: a wrong layer must come out red naming what is
wrong, a correct one green, and a module that cannot be used a usage error (exit 2).
"""

from __future__ import annotations

import json
import textwrap

import pytest
from rich.console import Console

from parity.cli import main

# A torch layer written the nanoGPT way, as a template: {q}, {k}, {out} are the lines a test changes.
TORCH_LAYER = '''
import math
import torch
import torch.nn.functional as F
from parity.impls import implementation


def attention(p, query, key, value, keep, *, num_heads, lin=F.linear, k_input=None, out_bias=True, dim=-1,
              additive=None):
    B, T, E = query.shape
    S, N = key.shape[1], num_heads
    H = E // N
    q = lin(query, p["q_proj.weight"], p["q_proj.bias"]).view(B, T, N, H).transpose(1, 2)
    k = lin(key if k_input is None else k_input, p["k_proj.weight"], p["k_proj.bias"]).view(B, S, N, H).transpose(1, 2)
    v = lin(value, p["v_proj.weight"], p["v_proj.bias"]).view(B, S, N, H).transpose(1, 2)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(H)
    att = scores
    if keep is not None:
        if additive is not None:  # scores + 0 / additive, as a float mask is added
            att = att + torch.zeros_like(att).masked_fill(~keep, additive)
        else:
            att = att.masked_fill(~keep, float("-inf"))
    weights = F.softmax(att, dim=dim)
    context = (weights @ v).transpose(1, 2).reshape(B, T, E)
    output = F.linear(context, p["out_proj.weight"], p["out_proj.bias"] if out_bias else None)
    return output, {"scores": scores, "weights": weights, "context": context, "output": output}


def layer(name, masked_rows="nan", **declared):
    def wrap(body):
        @implementation(name=name, framework="torch", mask="keep", masked_rows=masked_rows, returns_weights=False,
                        **declared)
        def factory(state_dict, num_heads, *, dtype, device):
            const = {n: torch.tensor(a.astype("float32")).to(getattr(torch, dtype)) for n, a in state_dict.items()}

            def fn(p, query, key, value, keep):
                return body(p, query, key, value, keep, num_heads=num_heads, const=const)[0]

            fn.intermediates = lambda *a: body(*a, num_heads=num_heads, const=const)[1]
            return fn

        return factory

    return wrap
'''

QUICK = ("--device", "cpu", "--no-progress", "--quick", "--impls", "torch")


def _module(tmp_path, monkeypatch, name: str, body: str, template: str = TORCH_LAYER) -> str:
    (tmp_path / f"{name}.py").write_text(template + textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _cli(tmp_path, *argv) -> tuple[int, list[dict]]:
    report = tmp_path / "report.json"
    code = main([*argv, "--json", str(report)])
    rows = json.loads(report.read_text())["rows"] if report.exists() else []
    return code, rows


def _mine(rows, impl, status=None):
    return [r for r in rows if r["impl"] == impl and (status is None or r["status"] == status)]


WRONG_GRADIENTS = '''
@layer("detached-key")
def detached_key(p, query, key, value, keep, *, num_heads, const):
    return attention(p, query, key, value, keep, num_heads=num_heads, k_input=key.detach())


@layer("ignores-params")
def ignores_params(p, query, key, value, keep, *, num_heads, const):
    return attention(const, query, key, value, keep, num_heads=num_heads)


@layer("doubled-q-grad")
def doubled_q_grad(p, query, key, value, keep, *, num_heads, const):
    w = p["q_proj.weight"]
    # The same forward, twice the gradient; out_proj.bias a constant, so its gradient is missing.
    return attention({**p, "q_proj.weight": 2 * w - w.detach(), "out_proj.bias": const["out_proj.bias"]},
                     query, key, value, keep, num_heads=num_heads)


@layer("no-bias-under-grad")
def no_bias_under_grad(p, query, key, value, keep, *, num_heads, const):
    return attention(p, query, key, value, keep, num_heads=num_heads, out_bias=not torch.is_grad_enabled())
'''


def test_wrong_torch_gradients_fail_and_name_the_tensor(tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, "user_wrong_grads", WRONG_GRADIENTS)
    impls = ("detached-key", "ignores-params", "doubled-q-grad", "no-bias-under-grad")
    attrs = ("detached_key", "ignores_params", "doubled_q_grad", "no_bias_under_grad")
    code, rows = _cli(tmp_path, *QUICK, "--checks", "forward,gradient", *(a for x in attrs for a in ("--impl", f"{mod}:{x}")))
    assert code == 1
    for impl in impls:  # the forward check (under no_grad) passes for every one of them
        fwd = [r for r in _mine(rows, impl) if r["check"] == "forward" and r["reference"] == "oracle"]
        assert fwd and all(r["status"] == "pass" for r in fwd), (impl, fwd)

    def failing(impl, quantity):
        return " ".join(r["message"] for r in _mine(rows, impl, "fail") if r["quantity"] == quantity and r["reference"] == "oracle")

    assert "fails: key" in failing("detached-key", "d_inputs") and "no gradient for key" in failing("detached-key", "d_inputs")
    assert "q_proj.weight" in failing("ignores-params", "d_params") and "no gradient for q_proj.weight" in failing("ignores-params", "d_params")
    doubled = failing("doubled-q-grad", "d_params")
    assert "q_proj.weight" in doubled.split("fails: ")[1] and "out_proj.bias" in doubled.split("fails: ")[1]
    assert "no gradient for out_proj.bias" in doubled
    assert failing("no-bias-under-grad", "output") and "the output of the gradient call" in failing("no-bias-under-grad", "output")
    assert "out_proj.bias" in failing("no-bias-under-grad", "d_params")
    assert not [r for r in rows if r["status"] == "skip" and r["impl"] in impls]  # no group is skipped
    assert all(r["status"] == "pass" for r in _mine(rows, "torch"))  # ours is not blamed


JAX_LAYER = '''
import jax
import jax.numpy as jnp
from parity.impls import implementation


def _heads(x, n):
    B, L, E = x.shape
    return x.reshape(B, L, n, E // n).transpose(0, 2, 1, 3)


def attend(p, query, key, value, keep, num_heads, stop_key=False):
    q = _heads(query @ p["q_proj.weight"].T + p["q_proj.bias"], num_heads)
    k = _heads(key @ p["k_proj.weight"].T + p["k_proj.bias"], num_heads)
    if stop_key:
        k = jax.lax.stop_gradient(k)
    v = _heads(value @ p["v_proj.weight"].T + p["v_proj.bias"], num_heads)
    s = jnp.einsum("BNTH,BNSH->BNTS", q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))
    if keep is not None:
        s = jnp.where(keep, s, -jnp.inf)
    w = jax.nn.softmax(s, axis=-1)
    ctx = jnp.einsum("BNTS,BNSH->BTNH", w, v).reshape(query.shape)
    return ctx @ p["out_proj.weight"].T + p["out_proj.bias"]
'''


def test_an_eager_jax_user_implementation_has_its_gradients_checked(tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, "user_eager_jax", '''
        @implementation(name="eager-stop-key", framework="jax", mode="eager", masked_rows="nan")
        def stop_key(state_dict, num_heads, *, dtype, device):
            return lambda p, q, k, v, keep: attend(p, q, k, v, keep, num_heads, stop_key=True)
    ''', template=JAX_LAYER)
    code, rows = _cli(tmp_path, *QUICK, "--checks", "gradient", "--impl", f"{mod}:stop_key")
    assert code == 1
    grads = [r for r in _mine(rows, "eager-stop-key") if r["reference"] == "oracle"]
    assert grads and not [r for r in grads if r["status"] == "skip"]
    bad = {r["quantity"]: r["message"] for r in grads if r["status"] == "fail"}
    assert set(bad) == {"d_inputs", "d_params"} and "fails: key" in bad["d_inputs"] and "k_proj.weight" in bad["d_params"]


CORRECT_PORT = '''
@implementation(name="port", framework="jax", mode="jit", masked_rows="nan")
def port(state_dict, num_heads, *, dtype, device):
    return lambda p, q, k, v, keep: attend(p, q, k, v, keep, num_heads)
'''


@pytest.mark.parametrize("checks", ["peers", "training", "sharded", "training,peers"])
def test_a_user_implementation_no_selected_check_runs_is_a_usage_error(checks, tmp_path, monkeypatch, capsys):
    mod = _module(tmp_path, monkeypatch, "user_port_checks", CORRECT_PORT, template=JAX_LAYER)
    code, rows = _cli(tmp_path, *QUICK, "--checks", checks, "--impl", f"{mod}:port")
    out = capsys.readouterr().out
    assert code == 2 and not rows  # found before anything ran: no report
    assert "port" in out and "forward, gradient" in out


LOAD_FAILURES = [
    ("import sys\nsys.exit(0)\n", "port", "SystemExit"),
    ("raise RuntimeError('no GPU here')\n", "port", "RuntimeError: no GPU here"),
    ("def broken(:\n", "port", "SyntaxError"),
    ("x = 1\n", "port", "has no attribute 'port'"),
]


@pytest.mark.parametrize("source, attr, error", LOAD_FAILURES)
@pytest.mark.parametrize("tool", ["mha-parity", "mha-bench"])
def test_a_module_that_does_not_load_is_a_one_line_usage_error(tool, source, attr, error, tmp_path, monkeypatch, capsys):
    name = f"user_load_{abs(hash((source, tool))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    if tool == "mha-parity":
        code = main(["--device", "cpu", "--no-progress", "--quick", "--impl", f"{name}:{attr}"])
    else:
        from parity.bench.cli import main as bench_main

        code = bench_main(["--impl", f"{name}:{attr}"], console=Console(width=400, force_terminal=False))
    captured = capsys.readouterr()
    out = (captured.out + captured.err).strip()
    assert code == 2
    lines = [line for line in out.splitlines() if name in line]
    assert len(lines) == 1 and error in lines[0], out


MUTATING = '''
@layer("zeroes-query")
def zeroes_query(p, query, key, value, keep, *, num_heads, const):
    result = attention(p, query, key, value, keep, num_heads=num_heads)
    if not torch.is_grad_enabled():
        query.zero_()
    return result


@layer("scales-weight")
def scales_weight(p, query, key, value, keep, *, num_heads, const):
    result = attention(p, query, key, value, keep, num_heads=num_heads)
    if not torch.is_grad_enabled():
        p["v_proj.weight"].mul_(0.5)
    return result
'''


def test_a_layer_that_changes_its_arguments_in_place_fails(tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, "user_mutating", MUTATING)
    code, rows = _cli(tmp_path, *QUICK, "--checks", "forward,gradient", "--impl", f"{mod}:zeroes_query",
                      "--impl", f"{mod}:scales_weight")
    assert code == 1
    zq = " ".join(r["message"] for r in _mine(rows, "zeroes-query", "fail") if r["quantity"] == "inputs")
    assert "forward call changed query in place" in zq
    sw = " ".join(r["message"] for r in _mine(rows, "scales-weight", "fail") if r["quantity"] == "inputs")
    assert "forward call changed v_proj.weight" in sw
    # Every call gets its own copies: the change spoils neither the harness's data nor the next call.
    grads = [r for r in _mine(rows, "scales-weight") if r["check"] == "gradient"]
    assert grads and all(r["status"] == "pass" for r in grads)
    assert all(r["status"] == "pass" for r in _mine(rows, "torch"))


def test_a_correct_16_bit_layer_is_not_failed_on_a_zero_gradient(tmp_path, monkeypatch):
    """k_proj.bias's true gradient is 0: rounding noise is judged against the scale it comes from."""
    mod = _module(tmp_path, monkeypatch, "user_port_bf16", CORRECT_PORT, template=JAX_LAYER)
    code, rows = _cli(tmp_path, "--device", "cpu", "--no-progress", "--cases", "self/random/nan", "--dtypes", "bfloat16",
                      "--checks", "gradient", "--impls", "torch", "--impl", f"{mod}:port")
    assert code == 0, [r for r in rows if r["status"] != "pass"]
    assert _mine(rows, "port", "pass")


def test_a_softmax_over_the_wrong_axis_is_blamed_on_the_weights(tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, "user_wrong_axis", '''
        @layer("softmax-over-queries")
        def wrong_axis(p, query, key, value, keep, *, num_heads, const):
            return attention(p, query, key, value, keep, num_heads=num_heads, dim=-2)
    ''')
    code, rows = _cli(tmp_path, "--device", "cpu", "--no-progress", "--cases", "self/random/nan", "--dtypes", "float32",
                      "--checks", "forward", "--impls", "torch", "--impl", f"{mod}:wrong_axis")
    assert code == 1
    bad = [r for r in _mine(rows, "softmax-over-queries", "fail") if r["reference"] == "oracle"]
    assert bad and {r["stage"] for r in bad} == {"weights"}
    message = bad[0]["message"]  # a fully masked row under "nan": the numbers first, the NaN placement after
    assert message.startswith("values off by") and message.index("values off") < message.index("NaN placement")


MASKED_ROW_LAYERS = '''
@layer("additive-mask")
def additive(p, query, key, value, keep, *, num_heads, const):
    return attention(p, query, key, value, keep, num_heads=num_heads, additive=float("-inf"))


@layer("finfo-min-added", masked_rows="uniform")
def finfo_min(p, query, key, value, keep, *, num_heads, const):
    return attention(p, query, key, value, keep, num_heads=num_heads, additive=torch.finfo(query.dtype).min)


@layer("finfo-min-declared", masked_rows="uniform", masked_row_grads="flow")
def finfo_min_declared(p, query, key, value, keep, *, num_heads, const):
    return attention(p, query, key, value, keep, num_heads=num_heads, additive=torch.finfo(query.dtype).min)
'''


@pytest.mark.parametrize("attr, impl, case, cause", [
    ("additive", "additive-mask", "self/random/nan", "additive mask"),
    ("finfo_min", "finfo-min-added", "self/random/zero", "finfo.min"),
])
def test_masked_row_gradient_differences_stay_red_and_say_why(attr, impl, case, cause, tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, f"user_masked_{attr}", MASKED_ROW_LAYERS)
    code, rows = _cli(tmp_path, "--device", "cpu", "--no-progress", "--cases", case, "--dtypes", "float32",
                      "--checks", "forward,gradient", "--impls", "torch", "--impl", f"{mod}:{attr}")
    assert code == 1
    mine = [r for r in _mine(rows, impl) if r["reference"] == "oracle"]
    assert all(r["status"] == "pass" for r in mine if r["check"] == "forward")  # the forward agrees
    d_inputs = next(r for r in mine if r["quantity"] == "d_inputs")
    assert d_inputs["status"] == "fail"
    assert cause in d_inputs["message"] and "query" in d_inputs["message"] and "(2, 0)" in d_inputs["message"]


def test_a_declared_masked_row_gradient_is_judged_as_declared(tmp_path, monkeypatch):
    """finfo.min added to masked scores, declared masked_row_grads="flow": torch autograd of this layer
    agrees with the oracle's flow gradient (reference.backward), so it passes."""
    mod = _module(tmp_path, monkeypatch, "user_masked_declared", MASKED_ROW_LAYERS)
    code, rows = _cli(tmp_path, "--device", "cpu", "--no-progress", "--cases", "self/random/zero", "--dtypes", "float32",
                      "--checks", "forward,gradient", "--impls", "torch", "--impl", f"{mod}:finfo_min_declared")
    assert code == 0 and _mine(rows, "finfo-min-declared", "pass")


def test_the_hf_peers_gradients_are_checked_under_their_declared_masked_rows():
    pytest.importorskip("transformers")
    import dataclasses

    from parity.harness import checks
    from parity.harness.matrix import default_matrix, draw_inputs
    from parity.harness.runner import _runners
    from parity.devices import resolve_device
    from parity.impls import builtin

    case = next(c for c in default_matrix() if c.name == "self/random/nan")  # a fully masked row
    unit = checks.Unit(case, "float32", draw_inputs(case, 0).in_dtype("float32"), _runners(resolve_device("cpu")), ("peers",))
    bert = builtin("hf-bert")
    as_declared = {r.quantity: r for r in checks.check_peers(unit, [bert]) if r.quantity.startswith("d_")}
    assert {q: r.status for q, r in as_declared.items()} == {"d_input": "pass", "d_params": "pass"}
    stopped = dataclasses.replace(bert, name="hf-bert-stop", masked_row_grads="stop")
    wrong = {r.quantity: r.status for r in checks.check_peers(unit, [stopped]) if r.quantity.startswith("d_")}
    assert wrong == {"d_input": "fail", "d_params": "fail"}  # the masked row's gradient is there, and judged


def test_a_declared_dtype_set_makes_the_others_skip_rows(tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, "user_dtypes", '''
        @layer("float32-only", dtypes=("float32",))
        def only32(p, query, key, value, keep, *, num_heads, const):
            return attention(p, query, key, value, keep, num_heads=num_heads)
    ''')
    code, rows = _cli(tmp_path, "--device", "cpu", "--no-progress", "--cases", "cross", "--dtypes", "float64,float32",
                      "--checks", "forward", "--impls", "torch", "--impl", f"{mod}:only32")
    assert code == 0
    by_dtype = {d: {r["status"] for r in _mine(rows, "float32-only") if r["dtype"] == d} for d in ("float64", "float32")}
    assert by_dtype == {"float64": {"skip"}, "float32": {"pass"}}
    assert "declares dtypes=float32" in _mine(rows, "float32-only", "skip")[0]["message"]


def test_a_negative_seed_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--device", "cpu", "--quick", "--seed", "-1"])
    assert e.value.code == 2 and "non-negative" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
def test_only_a_true_zero_gradient_gets_a_floor(dtype):
    """Softmax ignores a constant added to a row's scores, so sum_s dL/dk[s] = 0: k_proj.bias's true
    gradient is 0 and nothing else's is; the floor must leave every other bound as it was (in every
    dtype: float32 and float64 layers round their sums too)."""
    floored = {"k_proj.bias"}
    from parity import reference
    from parity.harness.matrix import default_matrix, draw_inputs
    from parity.tolerances import gradient_floors

    for case in default_matrix():
        if case.name not in ("self/random/nan", "self/padding/zero"):
            continue
        x = draw_inputs(case, 0)
        exact = reference.backward(x.state_dict, x.query, x.key, x.value, x.keep, x.cotangent,
                                   num_heads=case.shape.N, masked_rows=case.masked_rows)
        assert set(gradient_floors(exact, dtype)) == floored, case.name


@pytest.mark.parametrize("declared, status", [("flow", "pass"), ("stop", "fail")])
def test_torch_multihead_attention_gradients_are_what_its_declaration_says(declared, status):
    """torch.nn.MultiheadAttention adds its bool mask as -inf: a fully masked row's NaN reaches the
    query and key gradients, which is what masked_row_grads="flow" (with "nan") means."""
    import dataclasses

    from parity.harness import Case, Shape, run
    from parity.impls import builtin

    assert builtin("torch-mha").masked_row_grads == "flow"
    peer = dataclasses.replace(builtin("torch-mha"), name="torch-mha-as-user", role="user", runs_on=None,
                               masked_row_grads=declared)
    case = Case(Shape("t", B=3, T=5, S=7, E=12, N=3, cross=True), "random", "nan")  # a fully masked row
    report = run(cases=[case], dtypes=("float32",), checks=("gradient",), impls=("torch", peer), device="cpu")
    d_inputs = next(r for r in report.rows if r.impl == peer.name and r.reference == "oracle" and r.quantity == "d_inputs")
    assert d_inputs.status == status
    if status == "fail":
        assert "additive mask" in d_inputs.message
