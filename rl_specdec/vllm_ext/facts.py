"""What a run's driver knows of the installed vLLM before any engine starts, kept in a file per installation.

Loading a config checks it against vLLM's declarations and runs the hooks' probes: that imports most of vLLM,
10-12 s on 2 cores, in a process that then never runs vLLM (each engine imports it again in its own process).
The command-line entry points turn this store on (:func:`use_file`): each fact (the version, a feature's probe
failures, a declaration, a parsed schedule) is computed live the first time and written to
``$RL_SPECDEC_CACHE/vllm-facts/<key>.json``; later processes read it, and load a config without importing vLLM.

The key names the installation exactly: the hash of vLLM's ``RECORD`` (every installed file with its own hash),
torch's version, and the source of ``rl_specdec/vllm_ext`` (the probes and how declarations are read). A vLLM
without an installed ``RECORD`` (an editable install of a source tree) has no key: its facts are computed live.
Engine processes never use the store: they import vLLM anyway, and probe it live (``check_vllm``). Off (the
default, and in the tests' own process, where vLLM's classes may be patched), every fact is computed live.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

_on = False


def use_file(on: bool = True) -> None:
    """Answer facts from (and record them in) this installation's file, in this process."""
    global _on
    _on = on
    facts_path.cache_clear()
    _facts.cache_clear()


def fact(name: str, compute: Callable[[], Any]) -> Any:
    """``compute()`` (a JSON value), or what it returned the first time on this installation, when the store is on."""
    if not _on or (path := facts_path()) is None:
        return compute()
    facts = _facts(path)
    if name not in facts:
        facts[name] = compute()  # an exception is not recorded: the next process computes it again
        _write(path, facts)
    return facts[name]


@functools.lru_cache(maxsize=None)
def facts_path() -> Path | None:
    """This installation's file (None where vLLM has no installed RECORD)."""
    record = _vllm_record()
    if record is None:
        return None
    h = hashlib.sha256(record.encode())
    h.update(metadata.version("torch").encode())
    for src in sorted(Path(__file__).parent.glob("*.py")):
        h.update(src.name.encode() + src.read_bytes())
    root = Path(os.environ.get("RL_SPECDEC_CACHE", Path.home() / ".cache" / "rl_specdec"))  # as the models' cache
    return root / "vllm-facts" / f"{h.hexdigest()[:16]}.json"


def _vllm_record() -> str | None:
    """The RECORD of the distribution that installed the ``vllm`` package found on the path (not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    site = Path(next(iter(spec.submodule_search_locations))).parent
    for info in sorted(site.glob("vllm*.dist-info")):
        record = info / "RECORD"
        if record.is_file() and "\nvllm/__init__.py," in (text := "\n" + record.read_text()):
            return text
    return None


@functools.lru_cache(maxsize=None)
def _facts(path: Path) -> dict[str, Any]:
    try:
        facts = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or damaged: computed again and rewritten
        return {}
    return facts if isinstance(facts, dict) else {}


def _write(path: Path, facts: dict[str, Any]) -> None:
    """Atomically (two processes that write at once each leave a whole file; a fact one of them lost is computed
    again next time)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(facts, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:  # a read-only cache: the facts stay computed live
        pass
