"""The embedded corpus: English text that ships with every CPython, so training needs no download.

Built from two sources, in a fixed order:

* the interactive help topics of ``pydoc_data.topics`` (the language reference in prose), one
  document per topic, in sorted topic order;
* the docstrings of the standard-library modules in ``MODULES``, in that order: one document per
  module (its docstring and those of its functions), then one per class (the class docstring and
  those of its methods and properties), names in sorted order.

Only objects defined by the module itself (or by its C accelerator, e.g. ``_heapq`` for
``heapq``) count. The listed modules have the same contents on every platform and no import side
effects. The walk runs in a fresh, isolated interpreter (``python -I -S``, about 0.3 s, nothing
cached on disk) because libraries imported by the trainer monkeypatch the stdlib (e.g.
``inspect.getfile``) and ``-OO`` strips docstrings. So the corpus is byte-identical on every
machine with the same Python version, whatever else the process has imported (docstrings
seldom change between patch releases of one minor version; a listed module missing from this
Python is skipped).

``split_of(title)`` holds out ~5 % of the documents, chosen by a stable hash of the title, as
the ``validation`` split.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import logging
import subprocess
import sys
import types
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

# The project logger, by name: this file also runs as a script without the package importable.
logger = logging.getLogger("torchtitan")

Split = Literal["train", "validation"]

# Fixed list, in walk order. Left out on purpose: modules whose contents differ between
# platforms (os, sys, time, posix, signal, socket, select, selectors, subprocess, shutil,
# locale, getpass, multiprocessing, urllib.request, socketserver, asyncio's event loops), whose
# contents depend on linked libraries or optional builds (ssl, hashlib, sqlite3, decimal, ctypes,
# readline, curses, bz2, lzma, pyexpat), that act on import (antigravity, this, tkinter, turtle,
# idlelib, webbrowser, rlcompleter), and deprecated ones that warn on import (aifc, asyncore,
# cgi, imp, telnetlib, ...).
MODULES: tuple[str, ...] = (
    "abc",
    "argparse",
    "array",
    "ast",
    "asyncio.base_events",
    "asyncio.events",
    "asyncio.futures",
    "asyncio.locks",
    "asyncio.protocols",
    "asyncio.queues",
    "asyncio.streams",
    "asyncio.tasks",
    "asyncio.transports",
    "base64",
    "bdb",
    "binascii",
    "bisect",
    "builtins",
    "calendar",
    "cmath",
    "cmd",
    "code",
    "codecs",
    "codeop",
    "collections",
    "collections.abc",
    "colorsys",
    "compileall",
    "concurrent.futures._base",
    "concurrent.futures.thread",
    "configparser",
    "contextlib",
    "contextvars",
    "copy",
    "copyreg",
    "csv",
    "dataclasses",
    "datetime",
    "dbm.dumb",
    "difflib",
    "dis",
    "doctest",
    "email._header_value_parser",
    "email._policybase",
    "email.charset",
    "email.contentmanager",
    "email.feedparser",
    "email.generator",
    "email.header",
    "email.headerregistry",
    "email.message",
    "email.parser",
    "email.policy",
    "email.utils",
    "enum",
    "filecmp",
    "fileinput",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "gc",
    "genericpath",
    "getopt",
    "gettext",
    "glob",
    "graphlib",
    "gzip",
    "heapq",
    "hmac",
    "html",
    "html.parser",
    "http",
    "http.client",
    "http.cookiejar",
    "http.cookies",
    "http.server",
    "imaplib",
    "importlib",
    "importlib.abc",
    "importlib.metadata",
    "importlib.resources",
    "importlib.util",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "json.decoder",
    "json.encoder",
    "keyword",
    "linecache",
    "logging",
    "logging.config",
    "logging.handlers",
    "mailbox",
    "marshal",
    "math",
    "mimetypes",
    "modulefinder",
    "netrc",
    "ntpath",
    "numbers",
    "operator",
    "optparse",
    "pathlib",
    "pdb",
    "pickle",
    "pickletools",
    "pkgutil",
    "platform",
    "plistlib",
    "poplib",
    "posixpath",
    "pprint",
    "profile",
    "pstats",
    "py_compile",
    "pyclbr",
    "pydoc",
    "queue",
    "quopri",
    "random",
    "re",
    "reprlib",
    "runpy",
    "sched",
    "secrets",
    "shelve",
    "shlex",
    "smtplib",
    "stat",
    "statistics",
    "string",
    "stringprep",
    "struct",
    "symtable",
    "tabnanny",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "token",
    "tokenize",
    "tomllib",
    "trace",
    "traceback",
    "tracemalloc",
    "types",
    "typing",
    "unicodedata",
    "unittest.case",
    "unittest.loader",
    "unittest.main",
    "unittest.mock",
    "unittest.result",
    "unittest.runner",
    "unittest.suite",
    "urllib.error",
    "urllib.parse",
    "urllib.robotparser",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "wsgiref.handlers",
    "wsgiref.headers",
    "wsgiref.simple_server",
    "wsgiref.util",
    "wsgiref.validate",
    "xml.dom.minidom",
    "xml.etree.ElementTree",
    "xml.sax.handler",
    "xml.sax.saxutils",
    "xml.sax.xmlreader",
    "xmlrpc.client",
    "xmlrpc.server",
    "zipapp",
    "zipfile",
    "zipimport",
    "zoneinfo",
)

VALIDATION_EVERY = 20
"""One document in this many (by title hash) is held out for validation: ~5 %."""

# C types' slot wrappers (``__add__``, ``__init__``...) carry the same generic one-liner
# ("Return self+value.") in every class: noise, not text.
_GENERIC_DOC_TYPES = (types.WrapperDescriptorType, types.MethodWrapperType)


@dataclass(frozen=True)
class Document:
    """One document: a title, unique within its source, and its text."""

    title: str
    text: str


def split_of(title: str) -> Split:
    """The split a document belongs to, from a hash of its title that is the same in every
    process and on every machine (unlike ``hash()``, which is salted per process)."""
    digest = hashlib.sha256(title.encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:8], "little") % VALIDATION_EVERY
    return "validation" if bucket == 0 else "train"


def build_corpus() -> list[Document]:
    """All documents of the embedded corpus (both splits), in their fixed order."""
    cmd = [sys.executable, "-I", "-S", str(Path(__file__).resolve())]
    try:
        out = subprocess.run(cmd, capture_output=True, check=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError) as e:
        # E.g. an embedded interpreter without a usable sys.executable.
        stderr = getattr(e, "stderr", None) or b""
        reason = stderr.decode(errors="replace").strip().splitlines()[-1:] or [str(e)]
        logger.warning(
            f"building the embedded corpus in a fresh interpreter failed ({reason[0]}); building "
            "it in this process, where patched or -OO-stripped docstrings may make it differ"
        )
        return collect_documents()
    return [Document(**d) for d in json.loads(out)]


def collect_documents() -> list[Document]:
    """Walk the sources of the corpus in this process (``build_corpus`` runs this in a fresh
    interpreter, so the result does not depend on what this process has imported)."""
    from pydoc_data.topics import topics

    docs = [Document(f"topic:{name}", topics[name].strip()) for name in sorted(topics)]
    for module_name in MODULES:
        docs.extend(_module_documents(module_name))
    return [d for d in docs if d.text]


def corpus_documents(split: Split) -> list[Document]:
    """The documents of one split of the embedded corpus, in their fixed order."""
    return [d for d in build_corpus() if split_of(d.title) == split]


def _module_documents(module_name: str) -> list[Document]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(module_name)
    except ImportError:
        return []
    owners = {module_name, "_" + module_name.rsplit(".", 1)[-1]}
    functions: list[str] = []
    classes: list[Document] = []
    for name, obj in sorted(vars(module).items()):
        if name.startswith("__") or getattr(obj, "__module__", None) not in owners:
            continue
        if isinstance(obj, type):
            parts = [_section(f"class {module_name}.{name}", vars(obj).get("__doc__"))]
            for member_name, member in sorted(vars(obj).items()):
                if member_name != "__doc__":
                    parts.append(_section(f"{name}.{member_name}", _member_doc(member)))
            classes.append(Document(f"class:{module_name}.{name}", _join(parts)))
        elif callable(obj):
            functions.append(_section(f"{module_name}.{name}", getattr(obj, "__doc__", None)))
    header = _section(f"module {module_name}", module.__doc__)
    return [Document(f"module:{module_name}", _join([header, *functions])), *classes]


def _member_doc(member: object) -> object:
    if isinstance(member, (classmethod, staticmethod)):
        member = member.__func__
    if isinstance(member, _GENERIC_DOC_TYPES):
        return None
    if isinstance(member, property) or callable(member):
        return getattr(member, "__doc__", None)
    return None


def _section(heading: str, doc: object) -> str:
    # A repr with a memory address (e.g. a sentinel default in a generated dataclass signature)
    # would differ between runs, so such a docstring is dropped.
    if not isinstance(doc, str) or not doc.strip() or " at 0x" in doc:
        return ""
    return f"{heading}\n\n{inspect.cleandoc(doc)}"


def _join(parts: list[str]) -> str:
    # Aliases share one docstring under several names: keep each text once.
    seen: set[str] = set()
    kept = []
    for part in parts:
        body = part.partition("\n\n")[2]
        if part and body not in seen:
            seen.add(body)
            kept.append(part)
    return "\n\n".join(kept)


if __name__ == "__main__":
    # ``build_corpus`` runs this file as a script; ASCII JSON keeps stdout encoding-proof.
    sys.stdout.buffer.write(json.dumps([asdict(d) for d in collect_documents()]).encode("ascii"))
