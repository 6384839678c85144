"""The hyperparameters of every method, with their ranges and defaults, validated before anything
is stored; the worker trains on their resolved form.

Every field a user can set is here with its range; unknown keys are refused (a misspelt
``rloo_K`` silently ignored would cost a user a GPU-day).
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from service.core.validation import Strict
from service.tools.spec import MultiTurn

Auto = Literal["auto"]


MAX_STOP, MAX_STOP_CHARS = 4, 256  # OpenAI's number of stop strings; our bound on each one's length


def check_stop(stops: list[str] | None) -> list[str] | None:
    """Stop strings as OpenAI takes them (a training job's and a completion's): 1 to 4, none empty."""
    if stops is not None and not (1 <= len(stops) <= MAX_STOP and all(1 <= len(x) <= MAX_STOP_CHARS for x in stops)):
        raise ValueError(f"give 1 to {MAX_STOP} stop strings of 1 to {MAX_STOP_CHARS} characters each")
    return stops


class LoraSpec(Strict):
    """LoRA adapters through ``peft``; the reference model is the base with the adapter disabled."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    r: int = Field(16, ge=1, le=1024, description="Adapter rank.")
    alpha: float = Field(32.0, gt=0, le=65536, description="Scale: the update is (alpha / r) * B @ A.")
    dropout: float = Field(0.0, ge=0, lt=1.0, description="Dropout on the adapter's input.")
    target_modules: Annotated[list[str], Field(max_length=1024)] | Literal["all-linear"] = Field(
        "all-linear",
        description="Module names to adapt (e.g. ['q_proj', 'v_proj']), or 'all-linear' (every linear layer "
        "but the output head). Name 'embed_tokens' to adapt the input embeddings too.",
    )

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str] | str) -> list[str] | str:
        if isinstance(v, list):
            if not 1 <= len(v) <= 64:
                raise ValueError("give between 1 and 64 module names, or 'all-linear'")
            for name in v:
                if not re.fullmatch(r"[A-Za-z0-9_.]{1,128}", name):
                    raise ValueError(f"'{name}' is not a module name (letters, digits, '_' and '.')")
        return v


class TrainingHyperparameters(Strict):
    """What every method (supervised, DPO, reinforcement) takes: OpenAI's three, and the engine's
    optimisation, precision, LoRA, checkpoint and validation settings (docs/algorithm.md).
    ``"auto"`` (OpenAI's spelling) means the method's default (``AUTO``)."""

    AUTO: ClassVar[dict[str, Any]] = {
        "batch_size": 8,
        "n_epochs": 1,
        "learning_rate_multiplier": 1.0,
        "eval_samples": 32,
    }
    """What ``"auto"`` resolves to, per field."""

    batch_size: int | Auto = Field(8, description="Examples (prompts, conversations, pairs) per step.")
    learning_rate: float = Field(1e-5, gt=0, le=1.0, description="AdamW learning rate.")
    learning_rate_multiplier: float | Auto = Field(1.0, description="Scales learning_rate (OpenAI's name).")
    n_epochs: int | Auto = Field(1, description="Passes over the training file.")
    max_steps: int | None = Field(None, ge=1, le=10_000_000, description="Caps the number of steps.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    weight_decay: float = Field(0.0, ge=0, le=1.0, description="AdamW weight decay.")
    gradient_accumulation_steps: int = Field(
        1, ge=1, le=4096, description="Micro-batches per update; must divide batch_size."
    )
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field("constant", description="Learning-rate schedule.")
    warmup_ratio: float = Field(0.0, ge=0, lt=1.0, description="Fraction of the steps with a linear warmup.")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="auto: bf16 autocast on CUDA, fp32 on the CPU. Weights stay fp32 either way."
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in the backward pass.")
    lora: LoraSpec | None = Field(None, description="LoRA adapters {r, alpha, dropout, target_modules}; null = full.")
    checkpoint_interval: int = Field(0, ge=0, description="Steps between checkpoints; 0 = only the final one.")
    keep_checkpoints: int | None = Field(
        None, ge=1, le=100_000, description="Keep only the newest N checkpoints (the final one always stays)."
    )
    eval_interval: int | Auto = Field(
        "auto",
        description="Steps between validation passes (at least 1, as OpenAI's). auto: ten passes over the run; "
        "there are none without a validation_file.",
    )
    eval_samples: int | Auto = Field("auto", description="Validation examples scored per pass; auto = 32.")

    @field_validator("batch_size")
    @classmethod
    def _batch(cls, v: int | str) -> int | str:
        if v != "auto" and not (1 <= int(v) <= 4096):
            raise ValueError("must be between 1 and 4096")
        return v

    @field_validator("n_epochs")
    @classmethod
    def _epochs(cls, v: int | str) -> int | str:
        if v != "auto" and not (1 <= int(v) <= 1000):
            raise ValueError("must be between 1 and 1000")
        return v

    @field_validator("eval_interval")
    @classmethod
    def _eval_interval(cls, v: int | str) -> int | str:
        if v != "auto" and not (1 <= int(v) <= 10_000_000):
            raise ValueError("must be 'auto', or a number of steps of at least 1 (no validation_file: no passes)")
        return v

    @field_validator("eval_samples")
    @classmethod
    def _eval_samples(cls, v: int | str) -> int | str:
        if v != "auto" and not (1 <= int(v) <= 100_000):
            raise ValueError("must be 'auto' or between 1 and 100000")
        return v

    @field_validator("learning_rate_multiplier")
    @classmethod
    def _lrm(cls, v: float | str) -> float | str:
        if v != "auto" and not (0 < float(v) <= 1000):
            raise ValueError("must be greater than 0 and at most 1000")
        return v

    def _concrete(self) -> dict[str, Any]:
        """Every value, "auto" replaced by the method's default."""
        values = self.model_dump()
        for name, default in self.AUTO.items():
            if values.get(name) == "auto":
                values[name] = default
        return values


AdvantageEstimator = Literal["rloo", "grpo", "reinforce", "reinforce_mean"]
"""``advantage_estimator``'s values: ``worker.rloo.ESTIMATORS`` has a function for each."""


def least_rloo_k(estimator: str) -> int:
    """The fewest completions a prompt the estimator can use: a group baseline needs two, plain
    REINFORCE (no baseline) one."""
    return 1 if estimator == "reinforce" else 2


class ReinforcementHyperparameters(TrainingHyperparameters):
    """The reinforcement (RLOO) hyperparameters of docs/algorithm.md."""

    rloo_k: int = Field(
        4, ge=1, le=256, description="Completions sampled per prompt (group size k; 1 only with 'reinforce')."
    )
    compute_multiplier: float | Auto = Field(
        "auto",
        description="OpenAI's 'compute used for exploring': scales rloo_k (rounded, between 2 and 256, or 1 and 256 "
        "for reinforce); auto = 1.",
    )
    reasoning_effort: Literal["default", "low", "medium", "high"] = Field(
        "default", description="Accepted for OpenAI compatibility; no effect on these models (an event says so)."
    )
    max_new_tokens: int = Field(64, ge=1, le=32768, description="Longest completion, in tokens.")
    max_prompt_length: int = Field(512, ge=1, le=131072, description="Longer prompts keep their last tokens.")
    temperature: float = Field(1.0, gt=0, le=10.0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1.0, description="Nucleus sampling.")
    kl_coef: float = Field(0.05, ge=0, le=100.0, description="KL penalty to the frozen reference; 0 loads none.")
    kl_estimator: Literal["k1", "k3"] = Field("k1", description="k1: log-ratio; k3: exp(-d) - 1 + d.")
    kl_in_reward: bool = Field(True, description="Fold the KL into the reward (paper, TRL); false = a loss term.")
    ppo_epochs: int = Field(1, ge=1, le=64, description="Optimisation passes over one batch of rollouts.")
    clip_epsilon: float = Field(0.2, gt=0, lt=1.0, description="Ratio clip range (1 - eps, 1 + eps).")
    clip_epsilon_high: float | None = Field(None, gt=0, le=10.0, description="Upper clip; default clip_epsilon.")
    loss_aggregation: Literal["sequence_sum", "token_mean", "sequence_mean", "constant"] = Field(
        "sequence_sum",
        description="How per-token terms become the loss (docs/algorithm.md): sequence_sum (TRL's RLOO: summed "
        "over a completion, averaged over completions), token_mean (DAPO: every token of the batch weighs the "
        "same), sequence_mean (GRPO's: averaged over a completion first), constant (Dr. GRPO: summed, divided by "
        "max_new_tokens per completion).",
    )
    sampler_correction: Literal["auto", "tis", "mask", "none"] = Field(
        "auto",
        description="Where the sampler is not the policy itself (vLLM), its log-probs differ from the trainer's: "
        "tis weighs each token by the ratio trainer/sampler, truncated at sampler_correction_cap; mask leaves out "
        "a completion with a token whose ratio is past the cap either way; none ignores it; auto is tis with a "
        "sampler that reports its log-probs and top_p 1, none otherwise.",
    )
    sampler_correction_cap: float = Field(
        2.0, gt=1.0, le=1000.0, description="The truncation of tis, the bound of mask (a ratio above 1)."
    )
    drop_constant_groups: bool = Field(
        False,
        description="Leave groups whose rloo_k rewards are all equal out of the loss and its normaliser (they carry "
        "no reward signal under a group baseline; a KL folded into the reward goes with them); metric "
        "constant_groups_frac.",
    )
    advantage_estimator: AdvantageEstimator = Field(
        "rloo",
        description="rloo: leave-one-out baseline; grpo: group mean and std; reinforce: no baseline; "
        "reinforce_mean: the group mean including the completion.",
    )
    normalize_advantages: bool = Field(False, description="Whiten advantages over the batch.")
    reward_clip: float | None = Field(None, gt=0, description="Clip rewards to [-reward_clip, reward_clip].")
    mask_truncated_completions: bool = Field(
        False, description="Completions cut at max_new_tokens give no gradient (they still count in baselines)."
    )
    stop: list[str] | None = Field(
        None,
        max_length=64,
        description="Up to 4 strings that end a completion (kept in its tokens, cut from the graded text).",
    )
    sample_interval: int = Field(
        10,
        ge=0,
        le=1_000_000,
        description="Record a few prompts with their completions every N steps (and the last); 0: never.",
    )
    sample_groups: int = Field(
        2, ge=1, le=16, description="Prompts a recorded step keeps, each with its rloo_k completions."
    )

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: list[str] | None) -> list[str] | None:
        return check_stop(v)

    @field_validator("compute_multiplier")
    @classmethod
    def _compute(cls, v: float | str) -> float | str:
        if v != "auto" and not (0.00001 < float(v) <= 10):
            raise ValueError("must be 'auto' or greater than 0.00001 and at most 10")
        return v

    def resolved(self) -> ResolvedReinforcementHyperparameters:
        """All values concrete (no "auto"), ``rloo_k`` scaled by ``compute_multiplier`` (and kept
        where the estimator has a group: 2 at least, 1 for ``reinforce``): what a run reads, and
        what the job stores."""
        values = self._concrete()
        if values["compute_multiplier"] == "auto":
            values["compute_multiplier"] = 1.0
        least = least_rloo_k(values["advantage_estimator"])
        # A k below the estimator's least stays as given: job creation refuses it (service.jobs.spec), never a silent 2.
        if values["compute_multiplier"] != 1.0 and values["rloo_k"] >= least:
            values["rloo_k"] = min(256, max(least, round(values["rloo_k"] * values["compute_multiplier"])))
        return ResolvedReinforcementHyperparameters.model_validate(values)


class SupervisedHyperparameters(TrainingHyperparameters):
    """Supervised fine-tuning on chat examples (docs/algorithm.md): the loss is on assistant tokens."""

    AUTO: ClassVar[dict[str, Any]] = {**TrainingHyperparameters.AUTO, "n_epochs": 3}

    n_epochs: int | Auto = Field("auto", description="Passes over the training file; auto = 3.")
    max_length: int | None = Field(
        None, ge=8, le=131072, description="Longer examples keep their first tokens; default: the model's context."
    )
    packing: bool = Field(
        False, description="Pack short examples into rows of max_length (each still attends only to itself)."
    )

    def resolved(self) -> ResolvedSupervisedHyperparameters:
        return ResolvedSupervisedHyperparameters.model_validate(self._concrete())


class DpoHyperparameters(TrainingHyperparameters):
    """Direct preference optimisation on preference pairs (docs/algorithm.md)."""

    AUTO: ClassVar[dict[str, Any]] = {**TrainingHyperparameters.AUTO, "n_epochs": 3, "beta": 0.1}

    n_epochs: int | Auto = Field("auto", description="Passes over the training file; auto = 3.")
    beta: float | Auto = Field("auto", description="Strength of the pull to the reference (0 < beta <= 2); auto = 0.1.")
    max_length: int | None = Field(
        None, ge=8, le=131072, description="Longest prompt plus output, in tokens; default: the model's context."
    )

    @field_validator("beta")
    @classmethod
    def _beta(cls, v: float | str) -> float | str:
        if v != "auto" and not (0 < float(v) <= 2):
            raise ValueError("must be 'auto', or greater than 0 and at most 2")
        return v

    def resolved(self) -> ResolvedDpoHyperparameters:
        return ResolvedDpoHyperparameters.model_validate(self._concrete())


class _Resolved(TrainingHyperparameters):
    """A run's hyperparameters as the worker reads them (``hp.learning_rate``): the fields and ranges
    the API validated, every value concrete, frozen. ``model_dump()`` is what a job stores."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    # Concrete types; the ranges are the validators' above, inherited. eval_interval stays "auto"
    # (as OpenAI shows it): what it means depends on the run (``eval_every``).
    batch_size: int = 8
    n_epochs: int = 1
    learning_rate_multiplier: float = 1.0
    eval_samples: int = 32

    def eval_every(self, total_steps: int, *, has_validation: bool) -> int:
        """Steps between validation passes (0: none). ``auto``: ten passes over the run, the last at
        its last step, when there is a validation file."""
        if not has_validation:
            return 0
        if self.eval_interval == "auto":
            return max(1, math.ceil(total_steps / 10))
        return int(self.eval_interval)

    def total_steps(self, n_items: int) -> int:
        """``ceil(n_items * n_epochs / batch_size)``, capped by ``max_steps``."""
        steps = math.ceil(n_items * self.n_epochs / self.batch_size)
        return min(steps, self.max_steps) if self.max_steps else steps


class ResolvedReinforcementHyperparameters(_Resolved, ReinforcementHyperparameters):
    """A reinforcement run's hyperparameters, concrete (``rloo_k`` already scaled)."""

    compute_multiplier: float = 1.0


class ResolvedSupervisedHyperparameters(_Resolved, SupervisedHyperparameters):
    """A supervised run's hyperparameters, concrete."""

    n_epochs: int = 3


class ResolvedDpoHyperparameters(_Resolved, DpoHyperparameters):
    """A DPO run's hyperparameters, concrete."""

    n_epochs: int = 3
    beta: float = 0.1


AnyResolved = ResolvedReinforcementHyperparameters | ResolvedSupervisedHyperparameters | ResolvedDpoHyperparameters


class RLConfig(Strict):
    grader: dict[str, Any] = Field(description="The reward spec: a grader (see docs/api.md).")
    hyperparameters: ReinforcementHyperparameters = ReinforcementHyperparameters()
    tools: list[Any] | None = Field(
        None,
        max_length=32,
        description="Function tools the model may call during its rollouts, each with where it runs (docs/tools.md).",
    )
    multi_turn: MultiTurn | None = Field(None, description="The limits of a rollout that calls tools.")


class SupervisedConfig(Strict):
    hyperparameters: SupervisedHyperparameters = SupervisedHyperparameters()


class DpoConfig(Strict):
    hyperparameters: DpoHyperparameters = DpoHyperparameters()


MethodType = Literal["supervised", "dpo", "reinforcement", "rloo"]
METHOD_TYPES: tuple[str, ...] = ("supervised", "dpo", "reinforcement", "rloo")
HYPERPARAMETERS: dict[str, type[TrainingHyperparameters]] = {
    "supervised": SupervisedHyperparameters,
    "dpo": DpoHyperparameters,
    "reinforcement": ReinforcementHyperparameters,
    "rloo": ReinforcementHyperparameters,
}
"""Each method's hyperparameters (``rloo`` is our name for ``reinforcement``)."""
RESOLVED: dict[str, type[_Resolved]] = {
    "supervised": ResolvedSupervisedHyperparameters,
    "dpo": ResolvedDpoHyperparameters,
    "reinforcement": ResolvedReinforcementHyperparameters,
    "rloo": ResolvedReinforcementHyperparameters,
}


class Method(Strict):
    """OpenAI's ``method``: its ``type``, and that method's settings under the key of the same name
    (optional for ``supervised`` and ``dpo``, which have defaults for everything)."""

    type: MethodType
    supervised: SupervisedConfig | None = None
    dpo: DpoConfig | None = None
    reinforcement: RLConfig | None = None
    rloo: RLConfig | None = None

    @model_validator(mode="after")
    def _one_config(self) -> Method:
        if self.type in ("reinforcement", "rloo") and getattr(self, self.type) is None:
            raise ValueError(f"method.type is '{self.type}', so method.{self.type} must hold the grader")
        for other in METHOD_TYPES:
            if other != self.type and getattr(self, other) is not None:
                raise ValueError(f"method.type is '{self.type}'; remove method.{other}")
        return self

    @property
    def family(self) -> str:
        """``supervised``, ``dpo`` or ``reinforcement`` (which ``rloo`` is)."""
        return method_family(self.type)

    @property
    def config(self) -> SupervisedConfig | DpoConfig | RLConfig:
        cfg = getattr(self, self.type)
        if cfg is None:  # supervised or dpo without settings: every default
            cfg = SupervisedConfig() if self.type == "supervised" else DpoConfig()
        return cfg  # type: ignore[no-any-return]

    @property
    def grader(self) -> dict[str, Any] | None:
        cfg = self.config
        return cfg.grader if isinstance(cfg, RLConfig) else None


def method_family(method_type: str) -> str:
    """``supervised``, ``dpo`` or ``reinforcement`` (``rloo`` is our name for it)."""
    return "reinforcement" if method_type == "rloo" else method_type
