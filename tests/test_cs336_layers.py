"""adapters/cs336_layers.py: the suite's models rebuilt from a CS336 submission's cs336_basics
layers compute what the suite's torch.nn models compute, keep a tied weight one parameter, and map
the submission's names and layouts back; a submission without the layers is one clear error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from parallelism_conformance.adapters import cs336_layers
from parallelism_conformance.harness.rank import models

BASICS = Path(__file__).parent / "fixtures" / "cs336_submission" / "cs336-basics"
MODELS = [
    {"kind": "mlp", "inputs": 3, "hidden": 5, "outputs": 2, "dtype": "float64"},
    {"kind": "tied_lm", "vocab": 7, "width": 4, "hidden": 6, "context": 3, "dtype": "float64", "skips": False, "skips_in_unit": True},
]


@pytest.fixture
def basics(monkeypatch):
    monkeypatch.syspath_prepend(str(BASICS))
    yield
    for name in [m for m in sys.modules if m.startswith("cs336_basics")]:
        del sys.modules[name]


@pytest.mark.parametrize("spec", MODELS, ids=lambda s: s["kind"])
def test_the_rebuilt_model_computes_the_same_loss_and_maps_its_names_back(spec, basics):
    suite, rebuilt = models.build(spec, 3), models.build(spec, 3)
    renamed = cs336_layers.convert(rebuilt)
    from cs336_basics.model import Embedding, Linear

    assert not any(type(m) in (nn.Linear, nn.Embedding) for m in rebuilt.modules())
    assert any(isinstance(m, Linear) for m in rebuilt.modules())
    batch = models.make_batch(spec, 4, 5)
    torch.testing.assert_close(rebuilt(batch["inputs"], batch["targets"]), suite(batch["inputs"], batch["targets"]))
    full = renamed.full({name: p.detach() for name, p in rebuilt.named_parameters()})
    want = dict(suite.named_parameters())
    assert set(full) == set(want)
    for name, tensor in full.items():
        assert torch.equal(tensor, want[name]), name
    if spec["kind"] == "tied_lm":
        assert isinstance(rebuilt.embed, Embedding) and rebuilt.head.weight is rebuilt.embed.weight


def test_a_module_prefix_and_a_transposed_layout_are_mapped_back(basics, monkeypatch):
    import cs336_basics.model as model

    class Transposed(nn.Module):  # a Linear that stores (in, out), under another name
        def __init__(self, d_in, d_out):
            super().__init__()
            self.W = nn.Parameter(torch.zeros(d_in, d_out))

        def forward(self, x):
            return x @ self.W

    monkeypatch.setattr(model, "Linear", Transposed)
    spec = MODELS[0]
    suite, rebuilt = models.build(spec, 1), models.build(spec, 1)
    renamed = cs336_layers.convert(rebuilt)
    batch = models.make_batch(spec, 2, 0)
    torch.testing.assert_close(rebuilt(batch["inputs"], batch["targets"]), suite(batch["inputs"], batch["targets"]))
    full = renamed.full({f"module.{name}": p.detach() for name, p in rebuilt.named_parameters()})
    assert {name: t.shape for name, t in full.items()} == {name: p.shape for name, p in suite.named_parameters()}
    assert torch.equal(full["fc1.weight"], suite.fc1.weight)


def test_a_submission_without_cs336_basics_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cs336_basics", None)
    with pytest.raises(ImportError, match="cs336_basics.model cannot be imported"):
        cs336_layers.convert(models.build(MODELS[0], 0))


def test_a_template_package_that_reads_its_installed_version_imports_without_being_installed(tmp_path, monkeypatch):
    """The 2026 template's cs336_systems/__init__.py reads importlib.metadata.version at import:
    the declared name and version are served from pyproject.toml, nothing installed or run."""
    import importlib.metadata

    from parallelism_conformance.adapters import cs336_metadata

    (tmp_path / "pyproject.toml").write_text('[project]\nname = "cs336-systems-probe"\nversion = "26.1.1"\n')
    (tmp_path / "cs336-basics").mkdir()
    (tmp_path / "cs336-basics" / "pyproject.toml").write_text('[project]\nname = "cs336_basics_probe"\nversion = "26.0.0"\n')
    package = tmp_path / "cs336_systems_probe"
    package.mkdir()
    (package / "__init__.py").write_text('import importlib.metadata\n__version__ = importlib.metadata.version("cs336-systems-probe")\n')
    before = list(sys.meta_path)
    monkeypatch.setattr(sys, "meta_path", before)  # restored afterwards
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("cs336-systems-probe")
    assert cs336_metadata.declare(str(tmp_path)) == ["cs336-systems-probe 26.1.1", "cs336_basics_probe 26.0.0"]
    monkeypatch.syspath_prepend(str(tmp_path))
    import cs336_systems_probe

    assert cs336_systems_probe.__version__ == "26.1.1"
    assert importlib.metadata.version("cs336_basics_probe") == "26.0.0"
    assert cs336_metadata.declare(str(tmp_path / "missing")) == []
    del sys.modules["cs336_systems_probe"]


def test_a_submission_written_for_a_newer_python_says_so(tmp_path):
    from parallelism_conformance.adapters import cs336_metadata

    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\nversion = "1"\nrequires-python = ">=3.99,<4"\n')
    assert "asks for Python >=3.99,<4" in cs336_metadata.python_mismatch(str(tmp_path))
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\nversion = "1"\nrequires-python = ">=3.8"\n')
    assert cs336_metadata.python_mismatch(str(tmp_path)) == ""
    assert cs336_metadata.python_mismatch(str(tmp_path / "missing")) == ""


def test_the_layers_are_taken_from_where_the_submissions_own_tests_import_them(tmp_path):
    (tmp_path / "tests").mkdir()
    assert cs336_layers.layers_module(str(tmp_path)) == ("cs336_basics.model", "the handout's default")
    (tmp_path / "tests" / "test_ddp.py").write_text("from cs336_basics.layers import Linear\n")
    assert cs336_layers.layers_module(str(tmp_path)) == ("cs336_basics.layers", "tests/test_ddp.py")
    # both names in one import win over either alone, wherever in the file the import is (a class body)
    (tmp_path / "tests" / "test_fsdp.py").write_text(
        "import torch\nfrom .common import Linear\n\nclass Toy:\n    def __init__(self):\n"
        "        from cs336_basics.modules import Embedding, Linear, RMSNorm\n"
    )
    assert cs336_layers.layers_module(str(tmp_path)) == ("cs336_basics.modules", "tests/test_fsdp.py")
    (tmp_path / "tests" / "test_fsdp.py").write_text("def broken(:\n")  # unparsable: the next file decides
    assert cs336_layers.layers_module(str(tmp_path)) == ("cs336_basics.layers", "tests/test_ddp.py")


def test_a_submission_that_keeps_its_layers_in_a_module_of_its_own_is_rebuilt_from_it(basics, tmp_path, monkeypatch):
    package = tmp_path / "own_basics"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "modules.py").write_text("from cs336_basics.model import Embedding, Linear\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rebuilt = models.build(MODELS[0], 1)
    cs336_layers.convert(rebuilt, "own_basics.modules")
    from cs336_basics.model import Linear

    assert isinstance(rebuilt.fc1, Linear) or isinstance(getattr(rebuilt.fc1, "linear", None), Linear)
    with pytest.raises(ImportError, match="own_basics.missing cannot be imported"):
        cs336_layers.convert(models.build(MODELS[0], 1), "own_basics.missing")
    del sys.modules["own_basics.modules"], sys.modules["own_basics"]
