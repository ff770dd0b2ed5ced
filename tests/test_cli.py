import subprocess
import sys

import pytest

from parity.cli import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--fixture", "nope"], "unknown fixture 'nope'; valid: kda, lm, frozen"),
        (["run", "--matrix", "nope"], "unknown matrix 'nope'; valid: default, full, smoke"),
        (["run", "--paths", "legacy,fast"], "--paths: unknown value 'fast'; valid: legacy, native"),
        (["run", "--ranks", "3"], "--ranks: unknown value '3'"),
        (["plan", "--fixture", "kda", "--output-dtype", "float8"], "unknown value 'float8'; valid: natural, float32"),
        (["run", "--fault", "gremlin"], "--fault: unknown value 'gremlin'"),
        (["run", "-k", "fixture == 'nope'"], "no cells selected"),
        (["run", "-k", "ranks > 'x'"], "-k: cannot evaluate"),
        (["run", "-k", "1/0 == 1"], "-k: cannot evaluate"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_plan_prints_the_table_and_both_paths(capsys):
    assert main(["plan", "--fixture", "kda"]) == 0
    out = capsys.readouterr().out
    assert "blocks.0.holder.A_log" in out and "strict" in out
    assert "path requested=legacy taken=legacy" in out and "path requested=native taken=native" in out


def test_plan_shows_fallback_and_isolation_error(capsys):
    main(["plan", "--fixture", "mixed_storage"])
    assert "fallback: unit blocks.0 mixes trainable storage dtypes" in capsys.readouterr().out
    main(["plan", "--fixture", "unisolatable"])
    assert "cannot isolate blocks.0.lin.gain, blocks.1.lin.gain" in capsys.readouterr().out


def test_list_prints_cells_without_running(capsys):
    assert main(["run", "--matrix", "default", "--list", "-k", "fixture == 'kda' and path == 'native'"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == f"{len(out) - 1} cells" and all(line.startswith("kda/native/") for line in out[:-1])


def test_module_entry_point():
    proc = subprocess.run([sys.executable, "-m", "parity", "fixtures"], capture_output=True, text=True)
    assert proc.returncode == 0 and "smoke" in proc.stdout and "kda" in proc.stdout
