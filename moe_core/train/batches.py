"""The trainer's data: each step's micro-batches from token shards (the loader, or the mixture
loader over ``data.sources``) or synthetic walks, made one step ahead on a background thread
(``data.prefetch``), and the checks of the token data against the run before anything trains on
it."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console

from moe_core.ckpt.format import step_of
from moe_core.config import (
    DataConfig,
    RunConfig,
    SourceConfig,
    check_tokenizer_fits,
    check_validation_fits,
    fail,
)
from moe_core.data.errors import DataError
from moe_core.data.formats import (
    Vocabulary,
    check_recorded,
    open_source,
    run_vocabulary,
    sources_vocabulary,
)
from moe_core.data.loader import TokenLoader
from moe_core.data.manifest import MANIFEST, read_manifest, verify_data_dir
from moe_core.data.mixture import MixtureLoader
from moe_core.data.prefetch import Prefetcher, pinned
from moe_core.data.shards import SPLITS
from moe_core.data.synthetic import SyntheticTokens
from moe_core.model.context import with_layout
from moe_core.model.documents import Documents, documents_of
from moe_core.parallel.mesh import Mesh

# one step's micro-batches (host), their documents (train.document_mask) and the loader state
Produced = tuple[list[torch.Tensor], list[Documents] | None, dict[str, Any] | None]


def check_data_fits(cfg: RunConfig) -> None:
    """The token data's vocabulary and validation split against the run, from its manifest
    alone (another format: from its headers and sizes), before the model is built (refusals
    otherwise come after training steps)."""
    if cfg.data.sources:
        check_mixture_fits(cfg)
        return
    assert cfg.data.dir is not None
    if cfg.data.external:
        vocab = run_vocabulary(cfg.data, cfg.model.vocab_size)
        if cfg.train.document_mask and vocab.eos_id is None:
            fail(
                "train.document_mask",
                True,
                f"false here: data.tokenizer={cfg.data.tokenizer!r} names no EOS token, and "
                "documents are split after each EOS",
            )
        held_out = open_source(cfg.data, "validation", cfg.train.seq_len, vocab)
        where = f"the {cfg.data.format} corpus {held_out.root}"
        check_validation_fits(cfg.train, cfg.parallel.data_parallel, len(held_out), where)
        return
    manifest = read_manifest(cfg.data.dir)
    where = str(manifest.data_dir / MANIFEST)
    vocab = manifest.tokenizer["vocab_size"]
    check_tokenizer_fits(cfg.data, vocab, cfg.model.vocab_size, manifest=where)
    instances = manifest.tokens("validation") // (cfg.train.seq_len + 1)
    check_validation_fits(cfg.train, cfg.parallel.data_parallel, instances, where)


def check_mixture_fits(cfg: RunConfig) -> None:
    """Every source opened as the run reads it (sizes, dtypes against the vocabulary), its
    vocabulary against the model, one tokenizer for all sources (where their format records it;
    the others are read with it, ``formats.mixture_vocabulary``) and the first source's
    validation split against the evaluations."""
    seq_len, first = cfg.train.seq_len, None
    vocab = sources_vocabulary(cfg.data, cfg.model.vocab_size)
    for i, source in enumerate(cfg.data.sources):
        data = open_source(cfg.data.of_source(source), "train", seq_len, vocab)
        where = f"data source {source.name!r} ({source.dir})"
        check_tokenizer_fits(cfg.data, data.vocab_size, cfg.model.vocab_size, manifest=where)
        tokenizer = getattr(data, "tokenizer_id", None)
        if tokenizer is not None and first is not None and tokenizer != first[1]:
            fail(
                f"data.sources[{i}].dir",
                source.dir,
                f"a folder tokenized with the tokenizer of data source {first[0]!r} (sha256 "
                f"{first[1][:16]}..., this one {tokenizer[:16]}...): the same ids must mean the "
                "same text in every source",
            )
        if tokenizer is not None and first is None:
            first = (source.name, tokenizer)
    head = cfg.data.sources[0]
    held_out = open_source(cfg.data.of_source(head), "validation", seq_len, vocab)
    where = f"data source {head.name!r} ({head.dir})"
    check_validation_fits(cfg.train, cfg.parallel.data_parallel, len(held_out), where)


class Batches:
    """This rank's micro-batches step by step. Token data is verified (rank 0) when this is
    built; ``loader_state`` is the loader's position after the last step taken (what a
    checkpoint records: the loader itself may be a step ahead, prefetching)."""

    def __init__(
        self, cfg: RunConfig, mesh: Mesh, console: Console, warn: Callable[[str], None]
    ) -> None:
        tc = cfg.train
        self.cfg, self.mesh, self.device = cfg, mesh, mesh.device
        self.console, self._warn = console, warn
        self.data = SyntheticTokens(cfg.model.vocab_size, cfg.data.branching, tc.seed)
        self.vocab: Vocabulary | None = None  # an external corpus's (formats.run_vocabulary)
        self.loader: TokenLoader | MixtureLoader | None = None
        self._repeating: set[str] = set()  # mixture sources already said to repeat
        if cfg.data.sources:
            self.vocab = sources_vocabulary(cfg.data, cfg.model.vocab_size)
            self._verify_data()
            self.loader = MixtureLoader(
                cfg.data.sources,
                cfg.source_shares,
                tc.seq_len,
                tc.micro_batch_size,
                dp_rank=mesh.data_rank,
                dp_size=cfg.parallel.data_parallel,
                seed=tc.seed,
                datasets=[self.dataset("train", s) for s in cfg.data.sources],
            )
            self._train_iter = iter(self.loader)
        elif cfg.data.kind == "tokens":
            assert cfg.data.dir is not None
            if cfg.data.external:
                self.vocab = run_vocabulary(cfg.data, cfg.model.vocab_size)
            self._verify_data()
            self.loader = TokenLoader(
                self.dataset("train"),
                "train",
                tc.seq_len,
                tc.micro_batch_size,
                dp_rank=mesh.data_rank,
                dp_size=cfg.parallel.data_parallel,
                seed=tc.seed,
                global_batch=tc.global_batch_size,  # epochs of whole steps: any dp, one order
            )
            self._train_iter = iter(self.loader)
        self.loader_state = None if self.loader is None else self.loader.state_dict()
        self._prefetch: Prefetcher[Produced] | None = None
        # train.document_mask: the id after which a new document starts, and the documents of
        # the micro-batches ``take`` returned last (None without the mask)
        self.eos_id = self._eos_id() if tc.document_mask else None
        self.documents: list[Documents] | None = None

    def _eos_id(self) -> int:
        """The EOS id of the token data (a mixture's sources share their tokenizer)."""
        if isinstance(self.loader, MixtureLoader):
            found = {d.eos_id for d in self.loader.datasets}
        else:
            assert self.loader is not None
            found = {self.loader.dataset.eos_id}
        if None in found or len(found) != 1:
            fail(
                "train.document_mask",
                True,
                "false for this data: its EOS id, which separates documents, is not recorded",
            )
        return int(found.pop())  # type: ignore[arg-type]

    def documents_of(self, batches: list[torch.Tensor]) -> list[Documents] | None:
        """The packed documents of host ``batches`` (pinned where a GPU is the destination),
        or None without ``train.document_mask``; under context parallelism with this rank's
        varlen layout (``context.context_varlen``), computed here on the host."""
        if self.eos_id is None:
            return None
        docs = [documents_of(b[:, :-1], self.eos_id) for b in batches]
        if self.mesh.cfg.cp > 1:
            docs = [with_layout(d, self.mesh.cfg.cp, self.mesh.cp_rank) for d in docs]
        return [d.pin_memory() for d in docs] if self.device.type == "cuda" else docs

    def dataset(self, split: str, source: SourceConfig | None = None) -> Any:
        """The dataset of ``split`` the loaders read (our shards, or a corpus in another
        format: ``data.format``), or of a mixture's ``source``."""
        data = self.cfg.data if source is None else self.cfg.data.of_source(source)
        return open_source(data, split, self.cfg.train.seq_len, self.vocab)

    def held_out(self) -> Any:
        """The validation split evaluations read: the one folder's, a mixture's first source's."""
        sources = self.cfg.data.sources
        return self.dataset("validation", sources[0] if sources else None)

    def _resuming(self) -> bool:
        """Whether this start may resume a checkpoint (``train.resume`` and one is there): the
        corpus must then be the one recorded when the run began."""
        ckpts = Path(self.cfg.out_dir) / "checkpoints"
        found = ckpts.is_dir() and any(step_of(p.name) is not None for p in ckpts.iterdir())
        return self.cfg.train.resume and found

    def _verify_data(self) -> None:
        """Before the first step (rank 0, streamed, timed), every folder of ours hashed against
        its data manifest, every corpus of another format against the record of its checksums
        in ``out_dir`` on a resume, recorded there on a new run (a mixture: each source, its own
        record); ``data.verify_checksums=false`` skips that, saying what goes unchecked."""
        dc = self.cfg.data
        main = self.mesh.rank == 0
        problem: list[str | None] = [None]
        if main and dc.verify_checksums:
            parts = [(s.name, dc.of_source(s)) for s in dc.sources] or [(None, dc)]
            try:
                for name, data in parts:
                    tick = time.perf_counter()
                    done = self._verify_part(name, data)
                    said = done if name is None else f"data source {name!r}: {done}"
                    self.console.print(
                        f"{said} in {time.perf_counter() - tick:.1f} s "
                        "(data.verify_checksums=false skips this)",
                        highlight=False,
                        soft_wrap=True,
                    )
            except DataError as err:
                problem[0] = str(err)
        elif main:
            self._warn(
                "data.verify_checksums=false: shard sha256 not checked (sizes, headers and token "
                "ids still are), so bytes flipped within the vocabulary would train unnoticed"
            )
        if self.mesh.distributed:
            dist.broadcast_object_list(problem, src=0)
        if problem[0] is not None:
            raise DataError(problem[0])

    def _verify_part(self, name: str | None, data: DataConfig) -> str:
        """One folder's files hashed (``_verify_data``); what was done, in words."""
        if data.external:
            corpus = open_source(data, "train", self.cfg.train.seq_len, self.vocab)
            resuming = self._resuming()
            return check_recorded(corpus, self.cfg.out_dir, resuming=resuming, source=name)
        manifest = verify_data_dir(str(data.dir), checksums=True)
        shards = [manifest.data_dir / s["file"] for sp in SPLITS for s in manifest.shards(sp)]
        size = sum(path.stat().st_size for path in shards)
        return f"verified the sha256 of {len(shards)} shards ({size / 1e6:,.1f} MB)"

    def take(self, step: int) -> list[torch.Tensor]:
        """Step ``step``'s micro-batches, on the device (made ahead by ``prepare``); their
        packed documents go to ``documents``."""
        if self._prefetch is None:
            self._prefetch = Prefetcher(self._produce)
        batches, docs, self.loader_state = self._prefetch.take(step)
        self._say_repeats(step)
        self.documents = None if docs is None else [d.to(self.device, True) for d in docs]
        return [b.to(self.device, non_blocking=True) for b in batches]

    def seen(self) -> tuple[dict[str, int], dict[str, float]] | None:
        """A mixture's tokens trained on and epochs read per source, all ranks together, after
        the last step taken (None for one folder or synthetic data)."""
        if not isinstance(self.loader, MixtureLoader) or self.loader_state is None:
            return None
        return self.loader.seen(self.loader_state)

    def _say_repeats(self, step: int) -> None:
        """Warn once per source when a mixture's step reads a source past its first epoch."""
        seen = self.seen()
        if seen is None:
            return
        for name, epochs in seen[1].items():
            if epochs > 1 and name not in self._repeating:
                self._repeating.add(name)
                self._warn(
                    f"data source {name!r} repeats from step {step} on: the run reads more of it "
                    "than it holds (its epochs are in metrics.jsonl as data_epochs; moe plan "
                    "shows how many the run implies)"
                )

    def prepare(self, step: int) -> None:
        """Start making step ``step``'s micro-batches on the background thread."""
        self._prefetch.prepare(step)  # type: ignore[union-attr]

    def _produce(self, step: int) -> Produced:
        """Step ``step``'s micro-batches in host memory, their packed documents (with
        ``train.document_mask``), and the loader's state after them. Token shards: the loader's
        next ones (a step holds the same instances for any layout). Synthetic: sequences are
        numbered globally, and data rank ``d`` reads the ``d``-th contiguous slice of the
        step's batch."""
        tc = self.cfg.train
        if self.loader is not None:
            batches = [next(self._train_iter) for _ in range(self.cfg.micro_batches)]
            docs = self.documents_of(batches)
            return [pinned(b, self.device) for b in batches], docs, self.loader.state_dict()
        per_rank = tc.global_batch_size // self.cfg.parallel.data_parallel
        start = step * tc.global_batch_size + self.mesh.data_rank * per_rank
        return self.sequences(start, self.cfg.micro_batches), None, None

    def sequences(self, start: int, n_micro: int) -> list[torch.Tensor]:
        """Synthetic walks ``start ..`` as ``n_micro`` micro-batches in (pinned) host memory."""
        mb, seq_len = self.cfg.train.micro_batch_size, self.cfg.train.seq_len
        tokens = pinned(self.data.sequences(start, n_micro * mb, seq_len), self.device)
        return list(tokens.split(mb))

    def stop(self) -> None:
        """Drop a step made ahead; the loader goes back to where the last step left it."""
        if self._prefetch is None:
            return
        self._prefetch.close()
        self._prefetch = None
        if self.loader is not None and self.loader_state is not None:
            self.loader.load_state_dict(self.loader_state)
            self._train_iter = iter(self.loader)

    def resume_at(self, saved: dict[str, Any] | None) -> str | None:
        """Put the loader where a checkpoint's loader state ``saved`` says (nothing to do for
        synthetic data or a state without one); why not, when it was saved for other data."""
        if self.loader is None or saved is None:
            return None
        problem = self.loader.state_problem(saved)
        if problem is not None:
            return problem
        self.loader.load_state_dict(saved)
        self._train_iter = iter(self.loader)
        self.loader_state = self.loader.state_dict()
        return None
