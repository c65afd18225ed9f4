"""Training corpus of the bundled model: the running Python's standard-library sources.

Every machine that runs this project has the corpus, so the bundled model can be reproduced
without any download. The rules (documented in ``docs/bundled_model.md``):

* **Files**: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, except
  - installed third-party code and build artefacts (``site-packages``, ``dist-packages``,
    ``lib-dynload``, ``__pycache__``, ``config-*``, machine-specific ``_sysconfigdata*.py``);
  - test suites (any directory named ``test``, ``tests`` or ``idle_test``): distributions
    package them separately (Debian/Ubuntu ``libpython3.X-testsuite``), so keeping them would
    make the corpus depend on which OS packages happen to be installed;
  - generated data tables that are not code (``encodings/`` codec tables, ``pydoc_data/``).
* **Order**: sorted by the path relative to the stdlib root (POSIX separators).
* **De-duplication**: by SHA-256 of the content; the first path in sorted order is kept.
* **Split**: the files of :data:`HELD_OUT_FILES` (well-known modules present in Python 3.11,
  3.12 and 3.13) form the held-out set and are never trained on; a train file whose content equals
  a held-out file is dropped too. Everything else is the train split.

The texts still differ between Python versions; :func:`corpus_fingerprint` identifies a corpus so
that a training log records exactly which one a checkpoint saw.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

# Held-out modules: stable, well-known, mid-sized; none is deprecated for removal in 3.13.
HELD_OUT_FILES: Tuple[str, ...] = (
    "base64.py",
    "bisect.py",
    "calendar.py",
    "colorsys.py",
    "csv.py",
    "fnmatch.py",
    "fractions.py",
    "getopt.py",
    "glob.py",
    "graphlib.py",
    "heapq.py",
    "html/parser.py",
    "json/decoder.py",
    "json/encoder.py",
    "netrc.py",
    "pprint.py",
    "queue.py",
    "reprlib.py",
    "sched.py",
    "shlex.py",
    "string.py",
    "textwrap.py",
    "tomllib/_parser.py",
    "wave.py",
)

_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "lib-dynload", "__pycache__", "test", "tests",
     "idle_test", "encodings", "pydoc_data"}
)


@dataclass(frozen=True)
class SourceFile:
    """One corpus file: its stdlib-relative POSIX path and its text."""

    path: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """The de-duplicated, ordered corpus split into train and held-out files."""

    root: str
    train: Tuple[SourceFile, ...]
    held_out: Tuple[SourceFile, ...]

    def train_texts(self) -> List[str]:
        """Texts of the train split, in corpus order."""
        return [f.text for f in self.train]

    def held_out_texts(self) -> List[str]:
        """Texts of the held-out split, in :data:`HELD_OUT_FILES` order."""
        return [f.text for f in self.held_out]


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def _skip_dir(name: str) -> bool:
    return name in _SKIP_DIRS or name.startswith("config-")


def list_source_files(root: Optional[Path] = None) -> List[str]:
    """Corpus-eligible ``*.py`` paths under ``root`` (relative, POSIX, sorted)."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"standard-library directory {str(root)!r} does not exist")
    rels = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune skipped directories in place so os.walk never descends into site-packages.
        dirnames[:] = [d for d in dirnames if not _skip_dir(d)]
        base = Path(dirpath).relative_to(root)
        for name in filenames:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                rels.append((base / name).as_posix())
    return sorted(rels)


def _read(path: Path) -> Optional[str]:
    # A few stdlib files are deliberately not UTF-8 (encoding tests); they carry no signal here.
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def load_corpus(root: Optional[Path] = None, held_out: Sequence[str] = HELD_OUT_FILES) -> Corpus:
    """Read, de-duplicate and split the corpus; raise if a held-out file is missing."""
    root = Path(root) if root is not None else stdlib_root()
    rels = list_source_files(root)
    present = set(rels)
    missing = [h for h in held_out if h not in present]
    if missing:
        raise FileNotFoundError(
            f"held-out file(s) {', '.join(missing)} not found under {str(root)!r}; "
            "the held-out split needs every one of them"
        )
    held_set = set(held_out)
    held_files: List[SourceFile] = []
    held_hashes = set()
    for rel in held_out:
        text = _read(root / rel)
        if text is None:
            raise ValueError(f"held-out file {rel!r} is not valid UTF-8")
        held_files.append(SourceFile(rel, text))
        held_hashes.add(hashlib.sha256(text.encode("utf-8")).hexdigest())
    seen = set(held_hashes)
    train: List[SourceFile] = []
    for rel in rels:
        if rel in held_set:
            continue
        text = _read(root / rel)
        if text is None or not text.strip():
            continue
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        train.append(SourceFile(rel, text))
    return Corpus(root=str(root), train=tuple(train), held_out=tuple(held_files))


def corpus_fingerprint(corpus: Corpus) -> str:
    """SHA-256 over (split, path, content) of every file: identifies the exact corpus."""
    h = hashlib.sha256()
    for split, files in (("train", corpus.train), ("held_out", corpus.held_out)):
        for f in files:
            h.update(f"{split}\0{f.path}\0".encode("utf-8"))
            h.update(hashlib.sha256(f.text.encode("utf-8")).digest())
    return h.hexdigest()


def slice_corpus(corpus: Corpus, max_train_files: int, max_held_out_files: int) -> Corpus:
    """A small deterministic sub-corpus (every k-th train file) for tests and quick runs."""
    if max_train_files < 1 or max_held_out_files < 1:
        raise ValueError("slice_corpus needs at least one train and one held-out file")
    stride = max(1, len(corpus.train) // max_train_files)
    train = corpus.train[::stride][:max_train_files]
    return Corpus(corpus.root, tuple(train), corpus.held_out[:max_held_out_files])


def pack_token_stream(docs: Sequence[Sequence[int]], eot_id: int) -> torch.Tensor:
    """Concatenate token lists as ``eot doc0 eot doc1 ... eot`` (int64, 1-D).

    The leading separator makes the first token of every document a prediction target with the
    same context a document boundary gets everywhere else.
    """
    total = sum(len(d) for d in docs) + len(docs) + 1
    out = torch.empty(total, dtype=torch.long)
    out[0] = eot_id
    pos = 1
    for d in docs:
        n = len(d)
        out[pos:pos + n] = torch.as_tensor(list(d), dtype=torch.long)
        out[pos + n] = eot_id
        pos += n + 1
    return out


class PackedSequences:
    """Fixed-length training windows over a packed token stream.

    Window ``i`` holds tokens ``[o + i*T, o + i*T + T + 1)`` for an offset ``o``: the model reads
    the first ``T`` tokens and predicts the last ``T``; consecutive windows share one token, so
    every token after ``o`` is predicted once per pass. Training shifts ``o`` at random each epoch
    (a cheap augmentation for a corpus seen many times: the window boundaries move).
    """

    def __init__(self, stream: torch.Tensor, seq_len: int) -> None:
        if stream.dim() != 1:
            raise ValueError(f"token stream must be 1-D, got shape {tuple(stream.shape)}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if (stream.numel() - 1) // seq_len < 1:
            raise ValueError(
                f"token stream of {stream.numel()} tokens is too short for seq_len {seq_len}"
            )
        self.stream = stream
        self.seq_len = seq_len

    def num_windows(self, offset: int = 0) -> int:
        """How many full windows fit after ``offset``."""
        return max(0, (self.stream.numel() - 1 - offset) // self.seq_len)

    @property
    def num_sequences(self) -> int:
        """Full windows at offset 0 (one epoch's worth)."""
        return self.num_windows(0)

    def window(self, idx: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """The windows ``idx`` (starting at ``offset``) as a ``[len(idx), T + 1]`` tensor."""
        starts = offset + idx.view(-1, 1) * self.seq_len
        return self.stream[starts + torch.arange(self.seq_len + 1).view(1, -1)]

    def batches(self, batch_size: int, seed: int, epoch: int,
                shift: bool = True) -> Iterator[torch.Tensor]:
        """One epoch of ``[B, T + 1]`` batches in a seeded shuffled order.

        With ``shift`` the window offset is drawn from ``[0, T)`` per epoch. The remainder that
        does not fill a batch is dropped, unless the whole epoch is smaller than one batch.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        offset = int(torch.randint(0, self.seq_len, (1,), generator=g)) if shift else 0
        if self.num_windows(offset) < 1:
            offset = 0
        n = self.num_windows(offset)
        order = torch.randperm(n, generator=g)
        if n < batch_size:
            yield self.window(order, offset)
            return
        for start in range(0, n - batch_size + 1, batch_size):
            yield self.window(order[start:start + batch_size], offset)


def infinite_batches(data: PackedSequences, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Epoch after epoch of :meth:`PackedSequences.batches` (a fresh shuffle per epoch)."""
    epoch = 0
    while True:
        yield from data.batches(batch_size, seed, epoch)
        epoch += 1
