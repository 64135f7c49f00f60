"""``scripts/arch_check.py`` on small fake packages: each measure finds what it should and
leaves alone what it should not."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("arch_check", REPO / "scripts" / "arch_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["arch_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


arch = _load_script()
LAYERS = [("low", ("pkg.exp.low",)), ("high", ("pkg.exp.high",))]
CORE = [("tools", ("pkg.tools",)), ("exp", ("pkg.exp",))]


def _write(root: Path, files: dict[str, str]) -> Path:
    """``files`` (path: source) under ``root``, with every package's ``__init__`` (empty)."""
    for name, source in files.items():
        path = root / name
        for parent in path.relative_to(root).parents:
            init = root / parent / "__init__.py"
            if parent != Path(".") and not init.exists():
                init.parent.mkdir(parents=True, exist_ok=True)
                init.write_text('"""A package."""\n')
        path.write_text(textwrap.dedent(source))
    return root


def _measure(root: Path) -> dict[str, tuple[int, list]]:
    return arch.measure(root, LAYERS, CORE, package="pkg", experiment="pkg.exp")


def test_a_cycle_closed_by_a_type_checking_import_is_found(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/exp/a.py": "from pkg.exp import b\n",
            "pkg/exp/b.py": """\
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from pkg.exp.a import A
                """,
            "pkg/exp/c.py": "def f():\n    from pkg.exp import a\n",
        },
    )
    count, findings = _measure(tmp_path)["import_cycles"]
    assert count == 1
    assert findings[0].what == "cycle in pkg.exp: a, b"
    assert any("b -> a (type_checking)" in line for line in findings[0].detail)
    assert any("a -> b (top)" in line for line in findings[0].detail)


@pytest.mark.parametrize(
    "init, cycles", [('"""Nothing."""\n', 0), ("from pkg.exp.sub import x\n", 1)]
)
def test_only_a_package_init_that_does_something_closes_a_cycle(
    tmp_path: Path, init: str, cycles: int
) -> None:
    """``user`` imports ``sub.y``, which runs ``sub/__init__``; ``sub.x`` imports ``user``."""
    _write(
        tmp_path,
        {
            "pkg/exp/sub/x.py": "import pkg.exp.user\n",
            "pkg/exp/sub/y.py": "Y = 1\n",
            "pkg/exp/user.py": "from pkg.exp.sub.y import Y\n",
        },
    )
    (tmp_path / "pkg/exp/sub/__init__.py").write_text(init)
    count, findings = _measure(tmp_path)["import_cycles"]
    assert count == cycles
    if cycles:
        assert findings[0].what == "cycle in pkg.exp: sub, sub.x, user"
        assert any("user -> sub (top, via sub.y)" in line for line in findings[0].detail)


def test_a_package_s_own_modules_do_not_cycle_through_its_init(tmp_path: Path) -> None:
    """``sub.x`` runs after ``sub/__init__`` began: importing ``sub.y`` does not run it again."""
    _write(
        tmp_path,
        {
            "pkg/exp/sub/__init__.py": "from pkg.exp.sub.x import X\n",
            "pkg/exp/sub/x.py": "from pkg.exp.sub.y import Y\nX = Y\n",
            "pkg/exp/sub/y.py": "Y = 1\n",
        },
    )
    assert _measure(tmp_path)["import_cycles"] == (0, [])


def test_the_longest_chain_counts_a_cycle_as_one_node(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/exp/a.py": "from pkg.exp import b\n",
            "pkg/exp/b.py": "from pkg.exp import c\nimport pkg.tools.t\n",
            "pkg/exp/c.py": "from pkg.exp import d\n",
            "pkg/exp/d.py": "def f():\n    from pkg.exp import c\n",
            "pkg/tools/t.py": "",
        },
    )
    count, findings = _measure(tmp_path)["longest_chain"]
    assert count == 3
    assert [f.what for f in findings] == ["a -> b", "b -> {c, d}"]


def test_forwarding_methods_are_found_and_methods_that_compute_are_not(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/exp/inner.py": "class Inner:\n    pass\n",
            "pkg/exp/m.py": """\
                import threading
                from pkg.exp.inner import Inner

                class M:
                    def __init__(self, inner: Inner) -> None:
                        self.inner = inner
                        self._done = threading.Event()

                    def passes(self, x, y):
                        return self.inner.go(x, y)

                    def by_keyword(self, x, *, y):
                        \"\"\"A docstring does not count.\"\"\"
                        return self.inner.go(x, y=y)

                    def everything(self, *args, **kwargs):
                        self.inner.go(*args, **kwargs)

                    @property
                    def value(self):
                        return self.inner.value

                    def computes(self, x):
                        return self.inner.go(x + 1)

                    def adds_one(self, x):
                        return self.inner.go(x, 1)

                    def own(self, x):
                        return self.helper(x)

                    def done(self):
                        return self._done.is_set()

                    def __len__(self):
                        return self.inner.size()
                """,
        },
    )
    count, findings = _measure(tmp_path)["forwarding_methods"]
    found = {f.what.split(" ")[0] for f in findings}
    assert found == {"M.passes", "M.by_keyword", "M.everything", "M.value"}
    assert count == 4


def test_upward_calls(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/exp/other.py": "class Foo:\n    def __init__(self, cb=None): ...\n",
            "pkg/exp/w.py": """\
                import threading
                from dataclasses import dataclass
                from pkg.exp.other import Foo

                class Local:
                    def __init__(self, cb=None):
                        self.cb = cb

                @dataclass(frozen=True)
                class Frozen:
                    a: int = 0

                    def __post_init__(self):
                        object.__setattr__(self, "a", 1)

                class W:
                    def __init__(self, reporter: Foo) -> None:
                        self.reporter = reporter
                        self.x = 1
                        self.thread = threading.Thread(target=self._run, daemon=True)
                        self.thread.daemon = True

                    def _run(self):
                        pass

                    def _cb(self):
                        pass

                    def poke(self, other, tensor):
                        other.x = 1  # COUNTED
                        self.reporter.agreement = "agree"  # COUNTED
                        setattr(other, "y", 2)  # COUNTED
                        setattr(self, "z", 3)
                        tensor.grad = None
                        record = Local()
                        record.a = 1
                        obj = Foo()
                        obj.cb = self._cb  # COUNTED
                        Foo(cb=self._cb)  # COUNTED
                        Foo(lambda: self.x)  # COUNTED

                        def inner():
                            pass

                        Foo(inner)  # COUNTED
                        Local(self._cb)
                        threading.Thread(target=self._run)
                        sorted([], key=lambda v: v)
                        self.reporter.go(self._cb)  # COUNTED
                        self.reporter.register_state_dict_fn("k", self._cb, self._run)

                    def __getattr__(self, name):  # COUNTED
                        return getattr(self.reporter, name)

                DEFAULT = Foo(lambda: 0)
                """,
        },
    )
    count, findings = _measure(tmp_path)["upward_calls"]
    source = (tmp_path / "pkg/exp/w.py").read_text().splitlines()
    expected = {i + 1 for i, line in enumerate(source) if "# COUNTED" in line}
    assert {f.line for f in findings} == expected, [f"{f.line} {f.what}" for f in findings]
    assert count == len(expected) == 9
    whats = {f.what for f in findings}
    assert "writes other.x" in whats
    assert "writes self.reporter.agreement" in whats
    assert "stores self._cb in obj.cb" in whats
    assert "passes self._cb to Foo()" in whats
    assert "passes the closure inner to Foo()" in whats


def test_layer_violations_and_unplaced_modules(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/exp/low/a.py": "from pkg.exp.high import b\n",
            "pkg/exp/high/b.py": "def f():\n    from pkg.exp.low import a\n",
            "pkg/exp/lowish.py": "",
            "pkg/tools/t.py": "import pkg.exp.high.b\n",
        },
    )
    count, findings = _measure(tmp_path)["layer_violations"]
    whats = sorted(f.what for f in findings)
    assert whats == [
        "pkg.exp.low.a (low) imports pkg.exp.high.b (high), top",
        "pkg.tools.t (tools) imports pkg.exp.high.b (exp), top",
        "unplaced: pkg.exp.lowish is in no layer",
    ]
    assert count == 3


def test_main_reports_every_measure_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "arch.json"
    status = arch.main(["--json", str(out)])
    printed = capsys.readouterr().out.splitlines()
    report = json.loads(out.read_text())
    assert set(report["measures"]) == set(arch.LIMITS)
    assert status == (1 if report["over"] else 0)
    assert printed[-1] == "arch_check: ok" if status == 0 else printed[-1].startswith("arch_check:")
