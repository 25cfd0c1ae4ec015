"""bumblebee as a verl training-engine backend: ``BumblebeeEngine`` (verl 0.9, ``pip install "bumblebee[verl]"``).

verl's training workers drive an engine through ``verl.workers.engine.BaseEngine``:
``initialize``, ``train_mode()`` / ``eval_mode()``, ``optimizer_zero_grad``,
``forward_backward_batch(data, loss_function, forward_only)``, ``optimizer_step`` (grad norm),
``lr_scheduler_step``, ``train_batch`` / ``infer_batch`` (BaseEngine's own, on top of those),
``get_per_tensor_param``, ``get_data_parallel_rank/size/group``, ``to(device, model, optimizer,
grad)``, ``save_checkpoint`` / ``load_checkpoint``. Importing this module registers
``BumblebeeEngine`` in verl's ``EngineRegistry`` as backend ``"bumblebee"`` for
``model_type="language_model"`` (devices cuda and cpu), so
``EngineRegistry.new("language_model", "bumblebee", config=cfg)`` builds one.

Data, as verl's no-padding engines take it: a ``TensorDict`` of samples with nested (jagged)
``input_ids`` and ``position_ids``, the loss fields the loss function reads (``loss_mask``,
``response_mask``, ``old_log_probs``, ...), and non-tensor settings: ``micro_batch_size_per_gpu``
or ``use_dynamic_bsz`` + ``max_token_len_per_gpu``, ``temperature``, ``calculate_entropy``.
Micro-batches are verl's own (``prepare_micro_batches``: the same count on every dp rank);
each becomes one packed row (its samples back to back, position ids restarting) through
``Engine.forward_backward``, whose loss callback hands verl's loss function
``model_output = {"log_probs", "entropy"}`` as nested tensors aligned as verl's engines align them
(``log_probs[t] = log p(token t + 1)``). verl's losses are written for a mean over dp ranks
(they multiply by ``dp_size``, FSDP averages); bumblebee sums gradients over ranks, so the loss is
divided by ``dp_size`` before the backward. The return value is verl's
(``postprocess_batch_func``: ``model_output``, ``loss``, ``metrics``).

What is not mapped: LoRA adapters, Ulysses sequence parallelism (bumblebee's CP is configured
in its own config), value heads, verl's HF model construction (the model comes from the
bumblebee config, or ``model_config.local_path`` as a HF directory).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

try:
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine import BaseEngine, EngineRegistry
    from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches
except ImportError:
    raise ImportError(
        "bumblebee.integrations.verl needs verl: pip install 'bumblebee[verl]'"
    ) from None

from bumblebee.config import Config, ConfigError
from bumblebee.rl.batch import RLBatch
from bumblebee.rl.engine import Engine
from bumblebee.runtime.resolve import load_config


@dataclasses.dataclass
class _VerlLoss:
    """A bumblebee loss callback running verl's ``loss_function`` on one micro-batch."""

    loss_function: object
    micro_batch: object
    offsets: torch.Tensor
    dp_size: int
    needs_entropy: bool
    agg: str = "token-mean"
    all_targets: bool = True  # verl's losses mask themselves: every position gets its log-prob
    outputs: list = dataclasses.field(default_factory=list)

    def _nested(self, x_1T: torch.Tensor) -> torch.Tensor:
        return torch.nested.nested_tensor_from_jagged(
            x_1T.reshape(-1), self.offsets.to(x_1T.device)
        )

    def __call__(self, x):
        model_output = {"log_probs": self._nested(x.logprobs)}
        if x.entropy is not None:
            model_output["entropy"] = self._nested(x.entropy)
        if self.loss_function is None:
            loss, metrics = x.logprobs.sum() * 0.0, {}
        else:
            loss, metrics = self.loss_function(
                model_output=model_output, data=self.micro_batch, dp_group=None
            )
        self.outputs.append(
            {
                "model_output": {k: v.detach() for k, v in model_output.items()},
                "loss": float(loss.detach()),
                "metrics": metrics,
            }
        )
        return loss / self.dp_size, {}


@EngineRegistry.register(model_type="language_model", backend="bumblebee", device=["cuda", "cpu"])
class BumblebeeEngine(BaseEngine):
    """verl's engine interface over ``bumblebee.Engine``. ``config``: a bumblebee ``Config`` (default:
    the embedded one); ``model_config.local_path`` (verl's HFModelConfig) starts from a HF directory;
    ``optimizer_config.lr`` / ``clip_grad`` override ``train.lr`` / ``train.clip_grad``."""

    def __init__(
        self,
        model_config=None,
        engine_config=None,
        optimizer_config=None,
        checkpoint_config=None,
        *,
        config: Config | None = None,
        temperature: float = 1.0,
    ):
        super().__init__()
        cfg = config or load_config(None, [])
        if optimizer_config is not None:
            train = {
                k: getattr(optimizer_config, k)
                for k in ("lr", "clip_grad")
                if getattr(optimizer_config, k, None) is not None
            }
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))
        self.cfg, self.temperature, self.mode = cfg, temperature, None
        self.hf_path = getattr(model_config, "local_path", None)
        self.engine: Engine | None = None

    def initialize(self):
        if (
            self.cfg.parallel.cp > 1
        ):  # verl's nested outputs are whole sequences; a CP rank holds a share
            raise ConfigError(
                "the verl adapter runs parallel.cp = 1 (bumblebee's log-probs come back per CP "
                "shard inside the loss callback)"
            )
        self.engine = Engine(self.cfg, hf_path=self.hf_path, temperature=self.temperature)

    # ------------------------------------------------------------------ modes, offload, groups
    @property
    def is_param_offload_enabled(self) -> bool:
        return False

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return False

    @contextlib.contextmanager
    def _mode(self, name: str, ctx):
        with ctx():
            self.mode = name
            try:
                yield
            finally:
                self.mode = None

    def train_mode(self, **kwargs):
        return self._mode("train", self.engine.train_mode)

    def eval_mode(self, **kwargs):
        return self._mode("eval", self.engine.eval_mode)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        super().to(device, model=model, optimizer=optimizer, grad=grad)
        if torch.device(device).type == self.engine.device.type:
            self.engine.onload(params=model, grads=grad, optimizer=optimizer)
        else:
            self.engine.offload(params=model, grads=grad, optimizer=optimizer, device=device)

    def get_data_parallel_rank(self):
        return self.engine.get_data_parallel_rank()

    def get_data_parallel_size(self):
        return self.engine.get_data_parallel_size()

    def get_data_parallel_group(self):
        return self.engine.get_data_parallel_group()

    def is_mp_src_rank_with_outputs(self):
        return (
            True  # every rank returns the outputs of its rows (pp: broadcast from the last stage)
        )

    # ------------------------------------------------------------------ the step
    def optimizer_zero_grad(self):
        self.engine.zero_grad()

    def optimizer_step(self):
        return self.engine.optimizer_step()["grad_norm"]

    def lr_scheduler_step(self):
        """bumblebee's optimizer step already set the scheduled learning rate: report it."""
        return self.engine.optimizer.param_groups[0]["lr"]

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        dp_size = self.get_data_parallel_size()
        if "loss_mask" in data.keys():  # verl's global token count for its losses' normalization
            n = data["loss_mask"].values().sum().float().reshape(1)
            if dp_size > 1:
                dist.all_reduce(n, group=self.get_data_parallel_group())
            tu.assign_non_tensor(data, batch_num_tokens=n.item())
        tu.assign_non_tensor(data, dp_size=dp_size)
        micro_batches, indices = prepare_micro_batches(
            data=data, dp_group=self.get_data_parallel_group(), same_micro_num_in_dp=True
        )
        entropy = bool(tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False))
        outputs = []
        for mb in micro_batches:
            ids, pos = mb["input_ids"], mb["position_ids"]
            packed = RLBatch(
                ids.values()[None],
                pos.values()[None],
                torch.ones_like(ids.values(), dtype=torch.bool)[None],
            )
            callback = _VerlLoss(loss_function, mb, ids.offsets(), dp_size, entropy)
            self.engine.forward_backward(packed, callback, forward_only=forward_only)
            outputs += callback.outputs
        return postprocess_batch_func(output_lst=outputs, indices=indices, data=data)

    # ------------------------------------------------------------------ weights and checkpoints
    def get_per_tensor_param(self, **kwargs):
        """(HF name, full bf16 tensor) in 512 MB buckets gathered just in time; no PEFT config."""
        return (t for bucket in self.engine.weight_buckets() for t in bucket), None

    def save_checkpoint(
        self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs
    ):
        self.engine.save(local_path, step=global_step, keep=max_ckpt_to_keep)

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        self.engine.load(local_path)
