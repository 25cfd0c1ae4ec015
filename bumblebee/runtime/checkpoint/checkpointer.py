"""Crash-safe training checkpoints: save, resume on any layout (export to Hugging Face: export.py;
finding and validating a checkpoint directory: directory.py).

A checkpoint is a directory ``<out_dir>/checkpoints/step_<N>`` written with
``torch.distributed.checkpoint`` (DCP): every rank writes the part of the state it
owns, in parallel; nothing is gathered.

Every rank writes the range of each flattened global tensor it owns, so a
checkpoint saved on one layout loads into any other (checkpoint_state.py says how).

Crash safety. Ranks write into ``.tmp-step_<N>``; once every rank has written (a
collective), rank 0 writes ``complete.json`` (step, model shapes, the size of every
file) and renames the directory to ``step_<N>`` (atomic on POSIX), then prunes to
``keep_last``; a published checkpoint is never modified, pruning and replacing move it out
of sight before deleting it (publish.py), and rank 0 holds the directory's save lock for the
whole save. A kill at any point leaves earlier checkpoints untouched, and
``resume = "auto"`` takes the newest directory whose marker exists and whose files
all have their recorded sizes. The marker also records a CRC-32 per file
(integrity.py); loading verifies them and refuses a corrupt file by name. A Ctrl-C or SIGTERM
during a save is reported as such, never as the write error it caused inside torch.

Safety: the config is TOML, the marker JSON, DCP's metadata goes through an
allow-list unpickler and tensors load with ``weights_only`` (state.py); every name and size
inside a checkpoint is untrusted and every file is opened through reader.py.

Stored: fp32 parameters, optimizer state, the step (which is also the data position
and the LR-schedule position: both are pure functions of seed and step), each
rank's RNG states, the resolved config.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch
import torch.distributed as dist

from bumblebee import safe_write
from bumblebee.config import PrimitivesConfig
from bumblebee.config_parse import dump_toml
from bumblebee.errors import ConfigError, disk_full, out_of_room
from bumblebee.models import build_model
from bumblebee.models.base import persistent_buffers
from bumblebee.models.hf import CheckpointError
from bumblebee.runtime.checkpoint.directory import (
    FORMAT,
    MARKER,
    STEP_DIR,
    VERSION,
    check_fits,
    checkpoint_root,
    find_checkpoint,
    read_marker,
    saved_arch,
    saved_config,
)
from bumblebee.runtime.checkpoint.integrity import (
    HASH,
    checksum_files,
    file_checksum,
    verify_checksums,
)
from bumblebee.runtime.checkpoint.publish import discard, publish, save_lock, sweep
from bumblebee.runtime.checkpoint.reader import shown
from bumblebee.runtime.checkpoint.record import restore_set_aside, set_aside
from bumblebee.runtime.checkpoint.state import (
    Piece,
    load_pieces,
    read_dcp_metadata,
    rng_states,
    save_pieces,
    set_rng_states,
    state_pieces,
)
from bumblebee.runtime.launch.interrupts import signals_held, stop_signal

HF_SHARD_BYTES = 5 * 2**30


def _write_durably(path: str, text: str) -> None:
    safe_write.write_file(path, text, doing=f"write {os.path.basename(path)}")


# ------------------------------------------------------------------------------ the trainer's hook
_STREAM_KEYS = [
    ("train", k)
    for k in ("seed", "global_batch", "seq_len", "steps", "lr", "min_lr", "warmup_steps")
]


class Checkpointer:
    """Saves and restores one run's state. Every rank creates one right after the sharding
    wrap; ``resume``, ``save``, ``on_step`` and ``on_end`` are collective."""

    def __init__(self, cfg, ctx, model: torch.nn.Module, sharding, optimizer, *, stream=sys.stdout):
        self.cfg, self.ctx, self.model, self.stream = cfg, ctx, model, stream
        self.sharding, self.optimizer = sharding, optimizer
        self.root = checkpoint_root(cfg.train.out_dir)
        self.group = dist.group.WORLD if ctx.distributed else None  # every rank saves its part
        self._share = (ctx.rank, ctx.layout.world)  # this rank's place in the group (checksums)
        self.last_saved, self.last_path = -1, ""  # the newest checkpoint of this run

    def _say(self, text: str) -> None:
        if (
            self.ctx.rank == 0
        ):  # on a terminal, over the progress line in place (the next one follows below)
            erase = "\r\033[K" if getattr(self.stream, "isatty", lambda: False)() else ""
            self.stream.write(f"{erase}bumblebee: {text}\n")
            self.stream.flush()

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def _pieces(self) -> dict[str, Piece]:
        self.sharding.reshard()  # e.g. fsdp2's root unit, left gathered by an evaluation forward
        return state_pieces(
            self.model, self.sharding, self.optimizer, self.ctx.ep_rank, self.ctx.layout.ep
        )

    # -------------------------------------------------------------------- resume
    def resume(self, spec: str) -> int:
        """Load what ``train.resume`` names ("" = nothing); returns the step to continue from."""
        if spec:
            self._tidy(restore=spec == "auto")
        path = find_checkpoint(spec, self.cfg.train.out_dir, self._say) if spec else None
        if spec and path is None:
            self._say(f"no complete checkpoint in {self.root}; starting at step 0")
        step = self.load(path) if path else 0
        own = bool(path) and os.path.dirname(os.path.abspath(path)) == os.path.abspath(self.root)
        if own:
            self.last_saved, self.last_path = step, path
        if path:
            self._say(f"resumed from {path} at step {step}")
        self._set_aside(step if own else None)
        return step

    def _tidy(self, restore: bool) -> None:
        """Before a resume looks for checkpoints: what killed saves left is tidied (publish.py),
        and with ``restore`` (``--resume auto``) a record that a run stopped before its first save
        had set aside is moved back (record.py). Rank 0; collective."""
        if self.ctx.rank == 0 and os.path.isdir(self.root):
            with save_lock(self.root), signals_held():
                sweep(self.root)
                back = (
                    restore_set_aside(self.cfg.train.out_dir, self._same_run) if restore else None
                )
            if back:
                self._say(
                    f"{self.cfg.train.out_dir} held no complete checkpoint: continuing the record "
                    f"set aside in {back[0]} (the run that set it aside stopped before its first "
                    f"save; its record is in {back[1]})"
                )
        self._barrier()

    def _same_run(self, path: str) -> bool:
        """Whether checkpoint ``path`` is of this run: the same model, and the same data and
        schedule but for ``train.steps`` (continuing it is then what this run would compute)."""
        try:
            if read_marker(path)["arch"] != self.model.arch.to_hf_dict():
                return False
        except CheckpointError:
            return False
        changed = self._changes(path)
        return changed is not None and all(c.startswith("train.steps ") for c in changed)

    def _set_aside(self, continues_from: int | None) -> None:
        """Before this run writes anything: an earlier run's record in out_dir (metrics, config,
        checkpoints, export) is moved to ``out_dir/previous/`` unless this run continues it, and
        then what the continuation replaces is (runtime/checkpoint/record.py). Rank 0; collective.
        Ctrl-C / SIGTERM wait for the moves: the record is moved whole or not at all."""
        if self.ctx.rank == 0:
            with signals_held():
                moved = set_aside(
                    self.cfg.train.out_dir,
                    continues_from=continues_from,
                    config_text=dump_toml(self.cfg),
                )
            if moved:
                aside, names = moved
                self._say(
                    f"set aside the earlier record of {self.cfg.train.out_dir} ({', '.join(names)}) "
                    f"in {aside}"
                )
        self._barrier()

    def load(self, path: str) -> int:
        info = read_marker(path)
        verify_checksums(path, info, self.group, *self._share)  # every rank checks a share
        md = read_dcp_metadata(path, info)
        pieces = self._pieces()
        check_fits(path, info, md, pieces, whole=self.ctx.layout.pp == 1)
        rng = {
            k: Piece(torch.empty(tuple(s.size), dtype=s.properties.dtype), 0, tuple(s.size))
            for k, s in md.state_dict_metadata.items()
            if k.startswith(f"rng/{self.ctx.rank}/")
        }
        load_pieces(path, {**pieces, **rng}, self.group, info=info)
        self.sharding.after_load()  # e.g. zero1 refreshes its fp32 masters from the parameters
        set_rng_states({k: p.local for k, p in rng.items()})
        self._note_changes(path, info)
        return int(info["step"])

    def _changes(self, path: str, info: dict | None = None) -> list[str] | None:
        """What differs between checkpoint ``path``'s config and this run's in the keys that
        fix the data stream and the schedule; None if its config cannot be read."""
        try:
            saved = saved_config(path, info if info is not None else read_marker(path))
        except CheckpointError:
            return None
        if not saved:
            return None
        now = self.cfg.to_dict()
        keys = _STREAM_KEYS + [("data", k) for k in now["data"]]
        return [
            f"{s}.{k} {shown(_get(saved, s, k))} -> {now[s][k]!r}"
            for s, k in keys
            if _get(saved, s, k) != now[s][k]
        ]

    def _note_changes(self, path: str, info: dict | None = None) -> None:
        changed = self._changes(path, info)
        if changed:
            self._say(
                f"note: resuming with changed {', '.join(changed)}: "
                "the run will not continue the saved one exactly"
            )

    # -------------------------------------------------------------------- save
    def save(self, step: int) -> str:
        """Write ``step_<step>``: every rank its pieces, then rank 0 publishes atomically."""
        name = f"step_{step:08d}"
        final, tmp = os.path.join(self.root, name), os.path.join(self.root, f".tmp-{name}")
        lock, created = save_lock(self.root), False
        try:
            if self.ctx.rank == 0:
                try:
                    # a link planted for checkpoints/ or the step would take the save outside
                    try:
                        safe_write.make_dirs(self.root, root=self.cfg.train.out_dir)
                        safe_write.refuse_links(tmp, final)
                    except ConfigError as e:  # e.g. checkpoints/ replaced by a file meanwhile
                        raise CheckpointError(
                            f"{self.root}: cannot write a checkpoint ({e})"
                        ) from None
                    lock.acquire()  # another process saving here: wait for it to finish
                    sweep(self.root)  # left by a killed save (nobody else is saving now)
                    os.makedirs(tmp)
                    created = True
                except OSError as e:  # e.g. checkpoints/ became unwritable during the run
                    if out_of_room(e):
                        raise disk_full(self.root, f"write checkpoint {name}", e) from None
                    raise CheckpointError(
                        f"{self.root}: cannot write a checkpoint ({e.strerror or e})"
                    ) from None
            self._write(tmp, name, step)
        except BaseException as e:  # Ctrl-C or a write error before publication: no partial save
            if created:
                shutil.rmtree(tmp, ignore_errors=True)  # a no-op once published (renamed)
            if (stop := stop_signal(e)) is not None and stop is not e:
                raise stop.with_traceback(None) from None  # not the write error it caused
            # DCP's writes say the temporary directory; name the checkpoints'
            cause = getattr(e, "cause", e)
            if out_of_room(
                cause
            ):  # also the marker or config.toml; earlier checkpoints are untouched
                raise disk_full(self.root, f"write checkpoint {name}", cause) from None
            raise
        finally:
            lock.release()  # a no-op where not taken (the other ranks)
        self._barrier()  # nobody moves on before the checkpoint is published
        self.last_saved, self.last_path = step, final
        self._say(f"saved checkpoint {final} (step {step})")
        return final

    def _write(self, tmp: str, name: str, step: int) -> None:
        """Every rank writes its pieces into ``tmp`` and hashes a share; rank 0 publishes."""
        self._barrier()
        pieces = self._pieces()
        pieces.update(
            {k: Piece(v, 0, tuple(v.shape)) for k, v in rng_states(self.ctx.rank).items()}
        )
        save_pieces(tmp, pieces, self.group)
        shapes = {k[6:]: list(p.shape) for k, p in pieces.items() if k.startswith("model/")}
        if (
            self.group is not None
        ):  # every rank has written its files; pipeline stages hold different layers
            every = [None] * self.ctx.layout.world
            dist.all_gather_object(every, shapes, group=self.group)
            shapes = {k: v for d in every for k, v in d.items()}
        sums = checksum_files(tmp, sorted(os.listdir(tmp)), self.group, *self._share)
        if self.ctx.rank == 0:
            self._publish(tmp, name, step, shapes, sums)

    def _publish(
        self, tmp: str, name: str, step: int, shapes: dict[str, list[int]], sums: dict[str, str]
    ) -> None:
        # torch's writer opened its files by name: none may have been a link
        safe_write.refuse_links(*(os.path.join(tmp, n) for n in os.listdir(tmp)))
        _write_durably(os.path.join(tmp, "config.toml"), dump_toml(self.cfg))
        sums = {**sums, "config.toml": file_checksum(os.path.join(tmp, "config.toml"))}
        info = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "layout": self.ctx.layout.describe(),
            "sharding": self.cfg.primitives.sharding,
            "arch": self.model.arch.to_hf_dict(),
            "shapes": shapes,
            "files": {n: os.path.getsize(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp))},
            "hash": HASH,
            "checksums": dict(sorted(sums.items())),
        }
        _write_durably(os.path.join(tmp, MARKER), json.dumps(info, indent=1))
        publish(self.root, tmp, name)  # an older save of this step (a resumed run) is replaced
        self._prune(name)

    def _prune(self, written: str) -> None:
        """Keep the newest ``keep_last`` complete checkpoints (0: all), never the one just
        ``written``."""
        keep = self.cfg.train.keep_last
        if keep:
            done = sorted(
                (int(m.group(1)), n)
                for n in os.listdir(self.root)
                if (m := STEP_DIR.match(n)) and os.path.isfile(os.path.join(self.root, n, MARKER))
            )
            for _, name in done[:-keep]:
                if name != written:
                    discard(self.root, name)

    # -------------------------------------------------------------------- run hooks, export
    def on_step(self, step: int) -> None:
        """After optimizer step ``step``: save every ``train.save_every`` steps (0: never)."""
        every = self.cfg.train.save_every
        if every and step % every == 0:
            self.save(step)

    def on_end(self, step: int) -> None:
        """End of training: a final save (when saving is on, or for ``train.export_hf``, which
        the trainer then runs on ``last_path`` through runtime/checkpoint/export.py)."""
        if (self.cfg.train.save_every or self.cfg.train.export_hf) and self.last_saved != step:
            self.save(step)


def _get(table: dict, section: str, key: str):
    part = table.get(section, {})
    return part.get(key) if isinstance(part, dict) else None


def saved_lora(path: str, info: dict | None = None):
    """The ``model.lora`` (a ``LoraConfig``) of the run that wrote checkpoint ``path`` (``info``:
    its marker, read when None), from the config.toml saved in it; None without adapters (or
    without a readable config)."""
    from bumblebee.config import LoraConfig
    from bumblebee.config_parse import coerce

    table = _get(saved_config(path, read_marker(path) if info is None else info), "model", "lora")
    if not isinstance(table, dict) or not table.get("rank"):
        return None
    return coerce(table, LoraConfig, f"{path}/config.toml: model.lora")


def load_model(path: str) -> torch.nn.Module:
    """The whole model of checkpoint directory ``path`` in one process (checksums verified)."""
    info = read_marker(path)
    verify_checksums(path, info)
    # a router with a selection bias saved its buffer: build that router to receive it
    biased = any(k.endswith("mlp.gate.e_score_correction_bias") for k in info.get("shapes", {}))
    model = build_model(
        saved_arch(path, info),
        PrimitivesConfig(router="sigmoid_bias") if biased else None,
        lora=saved_lora(path, info),
    )
    named = list(model.named_parameters()) + persistent_buffers(model)
    pieces = {f"model/{n}": Piece(p.detach().view(-1), 0, tuple(p.shape)) for n, p in named}
    check_fits(path, info, read_dcp_metadata(path, info), pieces)
    load_pieces(path, pieces, info=info)
    return model
