"""What may change on a built trainer's `args` (issue 60): a setting every step reads afresh (`PPOConfig._LIVE`, beside
the declarations), or nothing. Any other PPOConfig field (one added later included) was taken by the trainer when it
was built (the rollout engine, the KL controller, the data, the models, the derived batch sizes), so assigning it then
is refused with the fix (`PPOConfig.hold`, `PPOConfig.__setattr__`), and so is a replacement config that changes one
(`HeldArgs`, the trainer's `args` attribute). PPOConfig names its live fields in `_LIVE`, not in the fields'
metadata: HfArgumentParser hands that to argparse."""

from __future__ import annotations

import weakref
from dataclasses import fields

from transformers import TrainingArguments

from .config_checks import _range_errors

# TrainingArguments fields hf_ppo copies when a trainer is built (the derived batch sizes, the models' dtype): refused
# after that too. Trainer's other fields stay Trainer's (it and its callbacks set some during a run).
_COPIED_TRAINER_FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16")
# The configs a built trainer holds, by id: a copy (`dataclasses.replace`, `copy.deepcopy`) is free to change.
_HELD: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
# The call that changes a refused setting of a running trainer, where there is one.
_AFTER_BUILD_FIX = {"kl_coef": "set the KL controller's coefficient, `trainer.kl_ctl.value = {new!r}`, which every "
                               "step reads (or build a new PPOLMTrainer with it)"}


def hold(config) -> None:
    """Called by `PPOLMTrainer` once built with `config`: from then on a setting it took is refused on assignment
    (`assign`), and so is a replacement config that changes one (`HeldArgs`)."""
    _HELD[id(config)] = config


def is_held(config) -> bool:
    """Whether a built trainer holds `config` (this object: not a copy of it)."""
    return _HELD.get(id(config)) is config


def assign(config, name: str, value) -> None:
    """`config.name = value`, PPOConfig's `__setattr__`: as usual before a trainer holds `config`; after that, a
    settled field is refused unless the value is the same, and a live one is taken if it is in its range (else the
    old value stays, and the error says the range)."""
    if not is_held(config) or name not in config.__dict__:
        return object.__setattr__(config, name, value)
    old = config.__dict__[name]
    if name in settled_fields(type(config)) and not same_value(old, value):
        raise AttributeError(changed_after_build(name, old, value))
    object.__setattr__(config, name, value)
    if name in live_fields(type(config)):
        errors = [line for line in _range_errors(config) if line.startswith(f"{name}=")]
        if errors:
            object.__setattr__(config, name, old)
            raise ValueError(f"trainer.args.{name}: {errors[0]}")


def live_fields(config_class) -> frozenset[str]:
    """The fields of `config_class` (PPOConfig) every step reads afresh (its `_LIVE`): assignable on a built trainer."""
    return frozenset(config_class._LIVE)


def settled_fields(config_class) -> frozenset[str]:
    """The fields a trainer takes when it is built: every PPOConfig field not live (`PPOConfig._LIVE`; one added later
    included) and the TrainingArguments fields hf_ppo copies (`_COPIED_TRAINER_FIELDS`)."""
    own = {f.name for f in fields(config_class)} - {f.name for f in fields(TrainingArguments)}
    return frozenset(own - live_fields(config_class)) | frozenset(_COPIED_TRAINER_FIELDS)


def changed_after_build(name: str, old, new) -> str:
    """The error for a settled field assigned on a built trainer's config: what it was, why it is refused, the fix."""
    fix = _AFTER_BUILD_FIX.get(name, "build a new PPOLMTrainer with it (`args=dataclasses.replace(trainer.args, "
                                     "{name}={new!r})`; to go on with this run, resume its checkpoint there)")
    return (f"trainer.args.{name} = {new!r} is refused: this trainer was built with {name}={old!r} and set up with it "
            "(the rollout engine, the KL controller, the data, the models or the batch sizes took it then), so the new "
            f"value would be half applied. To change it, {fix.format(name=name, new=new)}.")


def same_value(old, new) -> bool:
    """Equal and of one type (1 is not True, 1.0 not 1): an assignment that changes nothing."""
    try:
        return bool(old == new) and type(old) is type(new)
    except Exception:  # noqa: BLE001 - a value that cannot compare is another value
        return False


class HeldArgs:
    """`PPOLMTrainer.args`: Trainer's `args` attribute, except that replacing a built trainer's config with one that
    changes a settled field (`trainer.args = dataclasses.replace(trainer.args, temperature=0.3)`) is refused as an
    assignment of that field is."""

    def __get__(self, trainer, owner=None):
        if trainer is None:
            return self
        try:
            return trainer.__dict__["_held_args"]
        except KeyError:
            raise AttributeError("args") from None

    def __set__(self, trainer, args) -> None:
        old = trainer.__dict__.get("_held_args")
        if old is not None and is_held(old) and args is not old:
            changed = sorted(name for name in settled_fields(type(old))
                             if not same_value(getattr(old, name, None), getattr(args, name, None)))
            if changed:
                first = changed[0]
                raise AttributeError(changed_after_build(first, getattr(old, first, None), getattr(args, first, None))
                                     + (f" (It also changes {', '.join(changed[1:])}.)" if changed[1:] else ""))
            if isinstance(args, type(old)):
                hold(args)
        trainer.__dict__["_held_args"] = args
