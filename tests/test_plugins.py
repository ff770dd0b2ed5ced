"""Plugin seams: paths and models from outside parity, and a layout whose stages stay apart."""

import csv
import dataclasses
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from parity.model.plan import PrecisionConfig, resolve_plan
from parity.paths import plan_sharding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OWN_MODEL = os.path.join(ROOT, "examples", "own_model", "my_model.py") + ":parity_model"


def _parity(*args, env=None, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "parity", *args], capture_output=True, text=True, env=env, cwd=cwd)


def _rows(out):
    with open(os.path.join(out, "cells.csv")) as fh:
        return list(csv.DictReader(fh))


def test_the_reference_loads_nothing_distributed_and_no_worker_module():
    code = textwrap.dedent("""
        import sys, torch
        before = {m for m in sys.modules if m.startswith("torch.distributed")}
        import parity.judge.reference
        added = sorted(m for m in sys.modules if m.startswith("torch.distributed") and m not in before)
        added += sorted(m for m in sys.modules if m.startswith(("parity.execute", "parity.runner", "parity.faults")))
        print(added)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_importing_parity_never_imports_a_top_level_fixtures_package(tmp_path):
    shadow = tmp_path / "fixtures"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('someone else's fixtures package')\n")
    code = "import sys, parity.model.registry as r; print(len(r.registry())); print('fixtures' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["15", "False"]


class ExpertBank(nn.Module):
    """A root whose FP32 minority is exactly a ModuleList (no forward)."""

    _keep_in_fp32_modules_strict = ["routers"]

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.routers = nn.ModuleList([nn.Linear(16, 2) for _ in range(3)])

    def forward(self, x):
        x = self.proj(x)
        return x + sum(r(x.float()).sum(-1, keepdim=True) for r in self.routers).to(x.dtype)


def test_a_forwardless_container_minority_is_sharded_through_its_children():
    model = ExpertBank()
    plan = resolve_plan(model, PrecisionConfig())
    report = plan_sharding(model, ("",), plan, "legacy")
    assert [u.root for u in report.units] == ["routers.0", "routers.1", "routers.2", "<root>"]
    assert all(u.param_dtype == torch.float32 for u in report.units[:3])


class TiedAcrossUnits(nn.Module):
    """A BF16-stored embedding whose weight the head shares: both under the root."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 8, bias=False).to(torch.bfloat16)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(self.proj(self.embed(x.bfloat16()).float()).bfloat16())


class IntegerHolder(nn.Module):
    """A frozen integer parameter (a permutation) in a holder of its own."""

    def __init__(self):
        super().__init__()
        self.holder = nn.Module()
        self.holder.perm = nn.Parameter(torch.arange(8), requires_grad=False)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x[..., self.holder.perm])


def test_legacy_never_cuts_a_tied_parameter_from_its_aliases_and_plans_an_integer_group():
    """Legacy took a module by its parameters' first names: it made ``embed`` a unit while its
    alias ``head.weight`` stayed in the root's (plan and setup silent, FSDP's lazy init raised in
    every cell); an integer parameter's group crashed its plan (KeyError: torch.int64) (review)."""
    from parity.errors import IsolationError

    model = TiedAcrossUnits()
    with pytest.raises(IsolationError, match="cannot isolate embed.weight"):
        plan_sharding(model, ("",), resolve_plan(model, PrecisionConfig()), "legacy")
    model = IntegerHolder()
    report = plan_sharding(model, ("",), resolve_plan(model, PrecisionConfig()), "legacy")
    held = next(u for u in report.units if u.root == "holder")
    assert held.params == ("holder.perm",) and held.reduce_dtype == torch.float32


@pytest.mark.slow
@pytest.mark.xdist_group("plugins")
def test_a_forwardless_container_minority_trains_on_real_fsdp(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from parity.paths import shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = ExpertBank()
        plan = resolve_plan(model, PrecisionConfig())
        shard(model, "legacy", roots=("",), plan=plan, mesh=init_device_mesh("cpu", (1,)))
        model(torch.randn(2, 16)).sum().backward()
        assert model.routers[0].weight.grad is not None
    finally:
        dist.destroy_process_group()


def test_unknown_path_and_bad_model_factories_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad_model.py"
    bad.write_text(textwrap.dedent("""
        from parity.model import Fixture
        def not_a_fixture():
            return 42
        def wrong_root():
            from torch import nn
            return Fixture(name="m", description="", build=lambda: nn.Linear(2, 2), unit_roots=("blocks.0", ""),
                           blocks=(), make_batch=None, loss=None)
    """))
    cases = [
        (["run", "--paths", "legacy,fast"], "unknown value 'fast'; valid: legacy, native"),
        (["run", "--model", f"{bad}:not_a_fixture"], "returned int, not parity.model.Fixture"),
        (["run", "--model", f"{bad}:wrong_root"], "Fixture.make_batch must be callable"),
        (["run", "--model", f"{bad}:missing"], "has no attribute 'missing'"),
        (["plan", "--model", "no_such_pkg.mod:make"], "cannot import no_such_pkg.mod"),
    ]
    from parity.cli import main

    # the first through a real process (its exit status and stderr), the rest in this one
    proc = _parity(*cases[0][0])
    assert proc.returncode == 2 and cases[0][1] in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    for argv, message in cases[1:]:
        code, err = main(argv), capsys.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1, (argv, err)


def _install_example(target) -> dict:
    src = os.path.join(ROOT, "examples", "external_path")
    uv = shutil.which("uv")
    if uv:
        cmd = [uv, "pip", "install", "--python", sys.executable, "--target", str(target), "--no-deps", src]
    else:
        cmd = [sys.executable, "-m", "pip", "install", "--target", str(target), "--no-deps", src]
    subprocess.run(cmd, check=True, capture_output=True)
    return {**os.environ, "PYTHONPATH": str(target)}


@pytest.mark.slow
@pytest.mark.xdist_group("plugins")
def test_an_installed_external_path_is_judged_and_paired_with_legacy_and_native(tmp_path):
    env = _install_example(tmp_path / "site")
    listed = _parity("fixtures", env=env)
    assert "owner_split    path (dtype-split)" in listed.stdout
    select = ["--matrix", "smoke", "-k", "fixture in ('frozen', 'unisolatable') and ranks == 1 and microbatches == 1"]
    for baseline, paths in (("legacy", "legacy,native,owner_split"), ("native", "native,owner_split")):
        out = tmp_path / baseline
        proc = _parity("run", *select, "--paths", paths, "--baseline", baseline, "--out", str(out), env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows = _rows(out)
        own = [r for r in rows if r["path"] == "owner_split"]
        assert own and {r["verdict"] for r in own} <= {"PASS", "SKIP"}
        pairs = [r for r in rows if r["path"] == f"{baseline}~owner_split"]
        assert pairs and {r["verdict"] for r in pairs if r["fixture"] == "frozen"} == {"PASS"}
        unpaired = [r for r in pairs if r["fixture"] == "unisolatable"]
        assert [r["verdict"] for r in unpaired] == ["UNPAIRED"]
        assert "raised the fixture's expected isolation error" in unpaired[0]["detail"]
        # a dtype-split plugin inherits the fixture's contract-keyed expectation
        iso = [r for r in own if r["fixture"] == "unisolatable"]
        assert [(r["check"], r["verdict"]) for r in iso] == [("expected_error", "PASS")]
        assert "owner_split dtype-split cannot isolate" in iso[0]["detail"]


def test_integer_inputs_without_token_input_are_one_line_naming_the_field():
    import dataclasses

    from parity.errors import UsageError
    from parity.model import Batch, Fixture
    from parity.model.spec import validate

    spec = Fixture(name="tok", description="", build=lambda: nn.Sequential(nn.Embedding(8, 4)), unit_roots=("",),
                   blocks=(), loss=lambda out, target: ((out - target) ** 2).mean(),
                   make_batch=lambda g: Batch(inputs=(torch.randint(0, 8, (2, 3), generator=g),),
                                              target=torch.zeros(2, 3, 4)))
    with pytest.raises(UsageError, match="inputs.0. is int64 but Fixture.token_input is False; set token_input=True"):
        validate(spec, "tok")
    assert validate(dataclasses.replace(spec, token_input=True), "tok").token_input


def test_a_path_plugin_named_like_a_built_in_path_is_refused(tmp_path):
    """An entry point whose path is called ``native`` would be judged in native's place (or be
    dropped for it), silently: exit 2 naming the entry point."""
    (tmp_path / "shadow_path.py").write_text(textwrap.dedent("""
        from parity_owner_split import OwnerSplitPath


        class Shadow(OwnerSplitPath):
            name = "native"
    """))
    info = tmp_path / "shadow_path-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: shadow-path\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[parity.paths]\nshadow = shadow_path:Shadow\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.path.join(ROOT, "examples", "external_path"),
                                                        ROOT])}
    done = subprocess.run([sys.executable, "-m", "parity", "run", "--paths", "legacy,native", "-k", "ranks == 1",
                           "--out", str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "parity.paths:shadow (shadow_path:Shadow) names its path 'native', as a built-in path does" in done.stderr
    assert not (tmp_path / "run").exists()


def test_a_plugin_that_fails_at_import_names_its_package_to_fix_or_uninstall(tmp_path):
    """An installed path plugin whose module raises at import: exit 2, one line naming the entry
    point, the failure and the package to fix or uninstall."""
    (tmp_path / "broken_path.py").write_text("raise ImportError('plugin broken at import')\n")
    info = tmp_path / "broken_path-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-path\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[parity.paths]\nbroken = broken_path:Path\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])}
    done = subprocess.run([sys.executable, "-m", "parity", "fixtures"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "parity.paths:broken (broken_path:Path) cannot be loaded" in done.stderr
    assert "ImportError: plugin broken at import; fix that plugin's package or uninstall it (pip uninstall broken-path)" \
        in done.stderr


MIXED_OP = '''
import torch
import torch.nn.functional as F
from torch import nn

from parity.model import Batch, Fixture


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(16))

    def forward(self, x):
        h = self.lin(torch.tanh(self.lin(x)))  # one weight used twice: its uses summed as FSDP sums them
        return self.weight * h.float()  # a BF16 weight times an FP32 activation (an RMSNorm's way)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Scaled()
        self.head = nn.Linear(16, 16)

    def forward(self, x):
        return self.head(self.block(x).to(self.head.weight.dtype))


def parity_model():
    return Fixture(name="mixed_op", description="a BF16 weight times an FP32 activation", build=Model,
                   unit_roots=("block", ""), blocks=("block",),
                   make_batch=lambda g: Batch(inputs=(torch.randn(4, 16, generator=g),),
                                              target=torch.randn(4, 16, generator=g)),
                   loss=lambda out, target: F.mse_loss(out.float(), target))
'''


def test_a_bf16_weight_meeting_an_fp32_activation_keeps_its_gradient_as_fsdp_does(tmp_path):
    """FSDP (torch 2.15) leaves an unsharded parameter's gradient in the dtype its op produced
    (``grad_dtype`` None; the reduce dtype on a no-sync window's first micro-batch), so
    ``weight * hidden.float()``'s weight gradient stays FP32; a reference rounding it to BF16
    failed every such weight (Hugging Face GptOss's RMSNorm; found by review), and one casting
    every use up would fail a weight used twice."""
    from parity.cli import main
    from parity.report.records import read_records

    source = tmp_path / "mixed_op.py"
    source.write_text(MIXED_OP)
    out = tmp_path / "run"
    code = main(["run", "--matrix", "smoke", "--model", f"{source}:parity_model", "-k",
                 "ranks == 1", "--out", str(out)])  # with and without sync
    failing = [f"{r.cell} {r.check} {r.name}" for r in read_records(str(out / "cells.csv")) if r.verdict != "PASS"
               and r.verdict != "SKIP"]
    assert code == 0 and not failing, failing


@pytest.mark.parametrize("plan, said", [
    ("raise KeyError('plan blew up')", "error: its plan() failed: KeyError: 'plan blew up' (a fault of that path's code)"),
    ("return None", "error: its plan() failed: TypeError: path 'broken': its plan() returned NoneType, not a "
                    "ShardReport; fix that path's plan()"),
    # units naming what the model does not have: named here, not as an isolation error about another
    # parameter or a KeyError while judging (review)
    ("r = type(self).__mro__[1].plan(self, *a, **k); u = r.units[0]; "
     "return replace(r, units=(replace(u, modules=('blocks.0.nope',), params=u.params + ('ghost.weight',)),) + r.units[1:])",
     "error: its plan() failed: TypeError: path 'broken': its plan() names module 'blocks.0.nope', parameter "
     "'ghost.weight', which the model does not have; fix that path's plan()"),
    # a parameter left out of every unit, or no unit at all: judged against units that do not exist (review)
    ("r = type(self).__mro__[1].plan(self, *a, **k); u = r.units[0]; "
     "return replace(r, units=(replace(u, params=u.params[1:]),) + r.units[1:])",
     "error: its plan() failed: TypeError: path 'broken': its plan() leaves '"),
    ("r = type(self).__mro__[1].plan(self, *a, **k); return replace(r, units=())",
     "error: its plan() failed: TypeError: path 'broken': its plan() reports no unit"),
    ("return None\ndef unavailable(self):\n    return True",
     "error: its plan() failed: TypeError: path 'broken': its unavailable() returned True, not None or a reason "
     "(a str); fix that path's unavailable()"),
])
def test_a_path_plugin_whose_plan_fails_is_named_and_plan_still_shows_the_other_paths(plan, said, monkeypatch, capsys):
    """One broken installed plugin must not turn ``parity plan`` into a traceback for every model,
    nor into exit 0: its crash is a finding (exit 1), named beside the other paths' plans."""
    from parity.cli import main
    from parity.paths import registry
    from parity.paths.legacy import LegacyPath

    namespace = {"replace": dataclasses.replace}
    exec(f"def plan(self, *a, **k):\n    {plan}\n", namespace)
    methods = {k: v for k, v in namespace.items() if k in ("plan", "unavailable")}
    broken = type("Broken", (LegacyPath,), {"name": "broken", **methods})()
    monkeypatch.setattr(registry, "_extra", {})
    registry.register(broken)
    assert main(["plan", "--fixture", "kda"]) == 1
    out = capsys.readouterr().out
    assert f"path requested=broken: {said}" in out and "requested=native" in out and "requested=legacy" in out
    monkeypatch.setattr(registry, "_extra", {})
    assert main(["plan", "--fixture", "unisolatable"]) == 0  # legacy's isolation error is its answer, not a crash
    assert "requested=legacy: error: legacy dtype-split cannot isolate" in capsys.readouterr().out


def test_a_path_plugin_whose_methods_parity_cannot_call_is_refused_when_registered(monkeypatch):
    """A wrong signature would fail every cell with a traceback, far from the cause (review)."""
    from parity.errors import UsageError
    from parity.paths import registry
    from parity.paths.legacy import LegacyPath

    monkeypatch.setattr(registry, "_extra", {})
    wrong = type("Wrong", (LegacyPath,), {"name": "wrong", "plan": lambda self, model: None})()
    with pytest.raises(UsageError, match=r"plan\(\) cannot be called as plan\(model, roots, plan, ignored\)"):
        registry.register(wrong)

    def fully_shard_by_dtype(model, mesh=None):  # a team's helper function, registered as it is
        raise AssertionError("not called by the check")
    with pytest.raises(UsageError, match="a sharding helper function is wrapped in a ShardingPath class"):
        registry.register(fully_shard_by_dtype)


def test_a_registered_path_named_like_another_or_falling_back_to_nothing_is_refused(monkeypatch):
    """``paths()`` kept the built-in under a clashing name, silently; an unregistered fallback
    was accepted, and every later path lookup raised for the rest of the process (review)."""
    from parity.errors import UsageError
    from parity.paths import get_path, registry
    from parity.paths.legacy import LegacyPath

    monkeypatch.setattr(registry, "_extra", {})
    with pytest.raises(UsageError, match="path 'legacy' is the name of a built-in path; give the registered path its own"):
        registry.register(type("Mine", (LegacyPath,), {"name": "legacy"})())
    with pytest.raises(UsageError, match="path 'bad' declares fallback 'nope', which is not registered"):
        registry.register(type("Bad", (LegacyPath,), {"name": "bad", "fallback": "nope"})())
    # a name that is no word broke cell ids and the comma-joined crossload field: every cell ERROR (review)
    for name in ("a,b", "", "x/y", 3):
        with pytest.raises(UsageError, match=f"path name {name!r} is not a word"):
            registry.register(type("Odd", (LegacyPath,), {"name": name})())
    assert registry._extra == {} and get_path("legacy")


@pytest.mark.slow
@pytest.mark.xdist_group("plugins")
def test_a_path_registered_in_this_process_reaches_the_rank_processes(tmp_path, monkeypatch):
    """Ranks start without the parent's ``register()``: every cell of such a path was an ERROR
    "unknown path" (review). One whose class the ranks cannot import is refused before any runs."""
    import parity
    from parity.errors import UsageError
    from parity.paths import registry

    monkeypatch.setattr(registry, "_extra", {})
    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples", "external_path"))
    from parity_owner_split import OwnerSplitPath

    registry.register(OwnerSplitPath())
    few = "fixture == 'frozen' and ranks == 1 and microbatches == 1"
    got = parity.run(matrix="smoke", filter=few, paths=["legacy", "owner_split"], out=str(tmp_path / "r"), quiet=True)
    own = [r for r in _rows(got.out) if r["path"] == "owner_split"]
    assert got.code == 0 and own and {r["verdict"] for r in own} <= {"PASS", "SKIP"}, own[:3]
    registry.register(type("Local", (OwnerSplitPath,), {"name": "local"})())
    with pytest.raises(UsageError, match="rank processes cannot import its class 'Local'; define the class at the top"):
        parity.run(matrix="smoke", filter=few, paths=["legacy", "local"], out=str(tmp_path / "l"), quiet=True)
    assert not os.path.exists(tmp_path / "l")
