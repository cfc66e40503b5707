"""mha-bench end to end (fake workers): an --impl declaring dtypes=("float32",) is a skip row naming
its declaration on the bfloat16 case, and the worker is never sent that item."""

from __future__ import annotations

import io
import json

from rich.console import Console

from parity.bench import cli, measure
from parity.bench.records import empty_row
from parity.bench.spec import BenchCase
from parity.bench.spec import IMPLS
from parity.impls import load_user_impl
from test_bench import FakeProc

USER = '''
from parity import convert
from parity.impls import implementation


@implementation(name="float32-only", framework="torch", mode="eager", mask="keep", masked_rows="nan",
                returns_weights=False, dtypes=("float32",))
def port(state_dict, num_heads, *, dtype, device):
    m = convert.to_torch(state_dict, num_heads).to(device)
    return lambda params, q, k, v, mask: m(q, k, v, mask, need_weights=False)[0]
'''


def _spawn(calls):
    """A worker that runs nothing: it resolves the spec's implementations as the real worker does
    (built-in and --impl), and answers each item with a measured row."""

    def spawn(spec, env):
        calls.append(spec)
        impls = {im.bench_key: im for im in (*IMPLS, *(i for s in spec["user_impls"] for i in load_user_impl(s)))}
        lines = [f"@@PEAK\t{json.dumps({'framework': 'torch', 'dtype': p['dtype'], 'gflops': 1e6})}" for p in spec["peaks"]]
        for item in spec["items"]:
            samples = [[1e-3] * 4] * 3
            stats = measure.summarize(measure.flat(samples))
            row = empty_row(impls[item["impl"]], BenchCase.of(**item["case"]), item["pass"], device=spec["device"]["name"],
                            status="ok", median_s=stats.median_s, iqr_s=stats.iqr_s, repeats=12, rounds=3, processes=1,
                            samples=samples)
            lines += [f"@@START\t{item['id']}", f"@@ROW\t{json.dumps({'id': item['id'], **row})}"]
        lines.append(f"@@PROBES\t{json.dumps({'items': [i['id'] for i in spec['items']], 'probes': [], 'threads': 1})}")
        return FakeProc(lines, rc=0)

    return spawn


def test_an_impl_declaring_float32_is_a_skip_row_on_bfloat16_and_never_reaches_the_worker(tmp_path, monkeypatch):
    (tmp_path / "bench_float32_only.py").write_text(USER)
    monkeypatch.syspath_prepend(str(tmp_path))
    out, calls = tmp_path / "b.json", []
    rc = cli.main(["--seq", "16", "--batch", "1", "--embed", "32", "--heads", "2", "--no-progress",
                   "--impls", "ours-torch:eager:fused", "--impl", "bench_float32_only:port", "--dtypes", "float32,bfloat16",
                   "--passes", "fwd", "--isolation", "run", "--processes", "1", "--json", str(out)],
                  console=Console(file=io.StringIO(), width=200), spawn=_spawn(calls))
    assert rc == 0
    rows = {(r["impl"], r["dtype"]): r for r in json.loads(out.read_text())["rows"]}
    mine = {d: r for (impl, d), r in rows.items() if impl.startswith("float32-only")}
    assert set(mine) == {"float32", "bfloat16"}
    assert mine["float32"]["status"] == "ok"
    assert mine["bfloat16"]["status"] == "skip"
    assert "float32-only declares dtypes=float32: bfloat16 is not among them" in mine["bfloat16"]["message"]
    assert {d for (impl, d), r in rows.items() if impl.startswith("ours-torch") and r["status"] == "ok"} == {"float32", "bfloat16"}
    # The worker gets the --impl to load, and of its items only the float32 one.
    (spec,) = calls
    assert spec["user_impls"] == ["bench_float32_only:port"]
    sent = {(item["impl"].split(":")[0], BenchCase.of(**item["case"]).dtype) for item in spec["items"]}
    assert sent == {("ours-torch", "float32"), ("ours-torch", "bfloat16"), ("float32-only", "float32")}
