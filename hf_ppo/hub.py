"""Publishing the trained policy: which files leave the machine, the model card, and the push itself.

Only the policy is published to the policy's repo: the LoRA adapter (or the merged model), its tokenizer, the card
and its plot. The value head, the reference and reward models, optimizer/scheduler/RNG state and `training_args.bin`
stay local, enforced twice: an allow-list of policy file names and a deny-list for everything training leaves
beside them. A push only reads the output folder, so a failed push loses nothing and can simply be retried.
A critic is published only on request, to a repo of its own (`push_critic`): what `save_critic` writes, and its card.
"""

from __future__ import annotations

import json
import logging
import os
import re
from importlib import metadata, resources
from pathlib import Path

from hf_ppo import gguf
from hf_ppo.adapters import save_policy
from hf_ppo.critic_store import CRITIC_INFO_FILE, CRITIC_STATE_FILE, save_critic
from hf_ppo.evaluation import final_evaluation
from hf_ppo.plots import metric_series, plot_training_curves

logger = logging.getLogger(__name__)

# Top-level files of a saved policy that may be published (fnmatch patterns, matched against the path in the
# folder). Anything in a subfolder never matches: checkpoints and saved reference/reward models live there.
# A model folder's weights, as `save_pretrained` writes them (a policy's, or a fully fine-tuned critic's).
MODEL_PATTERNS: list[str] = [
    "config.json",
    "model*.safetensors",
    "model*.safetensors.index.json",
]
TOKENIZER_PATTERNS: list[str] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
]
POLICY_ALLOW_PATTERNS: list[str] = [
    "adapter_config.json",
    "adapter_model.safetensors",
    "generation_config.json",
    *MODEL_PATTERNS,
    *TOKENIZER_PATTERNS,
    "README.md",
    "*.png",
]
# Never published, even where an allow pattern would match (e.g. `model*.safetensors` and a value head saved as
# `model_value_head.safetensors`, or `*.png` inside a checkpoint folder).
POLICY_IGNORE_PATTERNS: list[str] = [
    "*/*",
    "*value_head*",
    "training_args.bin",
    "trainer_state.json",
    "optimizer*",
    "scheduler*",
    "rng_state*",
    "scaler.pt",
    "*.pt",
    "*.pth",
]
_WEIGHT_PATTERNS = ["adapter_model.safetensors", "model*.safetensors"]

CARD_TEMPLATE = "policy_card.md.jinja"
PLOT_FILE = "training_curves.png"
CARD_TAGS = ["hf_ppo", "ppo", "rlhf"]
# (log-history key, label) of the metrics the card reports; the first one defines "best".
CARD_METRICS = [
    ("objective/scores", "reward (score)"),  # a reward model's, a function's or the weighted sum of several
    ("objective/kl", "KL to the reference"),
    ("rollout/response_length", "response length (tokens)"),
]
# LoRA fields worth showing, in this order; the rest of a PeftConfig dict is noise or a local path.
LORA_FIELDS = ["r", "lora_alpha", "lora_dropout", "target_modules", "bias", "use_rslora", "use_dora",
               "modules_to_save", "task_type"]
FRAMEWORKS = ["torch", "transformers", "peft", "trl", "huggingface_hub", "hf_ppo"]

# A Hub repo id: "name" or "namespace/name" (letters, digits, "-", "_", "."; no "..", no leading separator).
_HUB_ID = re.compile(r"^(?!.*\.\.)[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_SECRET_KEY = re.compile(r"token|secret|password|api_key|credential", re.IGNORECASE)


class HubPushError(RuntimeError):
    """A push to the Hub (of the policy, or of a critic) failed; nothing local changed and the push can be retried."""


# ---- Which files are the policy ------------------------------------------------------------------------------------
def policy_files(folder) -> list[str]:
    """The paths (relative, POSIX) in `folder` that `push_policy_folder` would upload, sorted."""
    from huggingface_hub.utils import filter_repo_objects

    folder = Path(folder)
    paths = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    return sorted(filter_repo_objects(paths, allow_patterns=POLICY_ALLOW_PATTERNS,
                                      ignore_patterns=POLICY_IGNORE_PATTERNS))


# ---- Merged export ---------------------------------------------------------------------------------------------------
def save_merged_policy(adapter_dir, base_source, folder, tokenizer, init_kwargs: dict | None = None) -> Path:
    """Merge the adapter saved in `adapter_dir` into its base reloaded in full precision; save it to `folder`.

    A quantized base is never merged into (that would re-quantize the merged weights): `base_source` must be the
    policy's Hub id or path, so the base loads again unquantized (`revision`, `token`, `dtype`... from
    `init_kwargs`).
    """
    import os

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if not isinstance(base_source, str) or not (os.path.isdir(base_source) or "/" in base_source):
        raise ValueError("push_merged_model needs the policy given by Hub id or path (the base is reloaded in full "
                         "precision to merge into); push the adapter instead (push_merged_model=False).")
    base_source, init_kwargs = gguf.converted(base_source, init_kwargs, "policy")  # the folder training loaded
    init = {k: v for k, v in (init_kwargs or {}).items()
            if k in ("revision", "token", "trust_remote_code", "cache_dir", "dtype")}
    base = AutoModelForCausalLM.from_pretrained(base_source, **init)  # it loaded at construction already
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)


# ---- What the trainer publishes --------------------------------------------------------------------------------------
CARD_HYPERPARAMETERS = [
    "learning_rate", "max_steps", "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps",
    "num_mini_batches", "num_ppo_epochs", "response_length", "temperature", "top_k", "top_p", "kl_coef",
    "kl_estimator", "adaptive_kl", "gamma", "lam", "cliprange", "cliprange_value", "vf_coef", "entropy_coef",
    "whiten_rewards", "missing_eos_penalty", "normalize_rewards", "policy_quantization", "ref_quantization",
    "reward_quantization", "seed", "loss_aggregation", "cliprange_low", "cliprange_high", "dual_clip",
    "advantage_estimator", "num_generations", "scale_rewards", "critic", "critic_warmup_steps", "critic_learning_rate",
    "critic_updates_per_step", "lam_critic", "critic_hub_model_id", "importance_sampling_level", "use_kl_loss",
    "use_bias_correction_kl", "drop_uniform_groups", "max_refill_rounds",
    "reward_weights", "normalize_each_reward", "overlong_buffer_length"]
# How the card names each critic and each critic-free estimator.
_CRITIC_TEXT = {"shared": "a value head on the policy's body", "separate": "a separate critic model",
                "reward_lora": "a LoRA critic on the reward model's frozen base"}
_ESTIMATOR_TEXT = {"rloo": "RLOO (leave-one-out baseline)", "grpo": "GRPO (group-normalised)",
                   "dr_grpo": "Dr. GRPO (group mean-centred)", "reinforce_pp": "REINFORCE++"}


def method_texts(hyperparameters: dict) -> tuple[str, str]:
    """(what the training was, what one iteration does after scoring) for the card, from the advantage estimator,
    `num_generations` and the critic: a card never says "GAE with a value head" about a critic-free run."""
    estimator = hyperparameters.get("advantage_estimator", "gae")
    if estimator == "gae":
        critic = _CRITIC_TEXT.get(hyperparameters.get("critic", "shared"), "a critic")
        return (f"clipped PPO with {critic} and a KL penalty towards a frozen reference",
                "subtracts a per-token KL penalty towards the reference, estimates advantages with GAE on the "
                "critic's values, and takes several clipped policy and value updates on the batch")
    if estimator == "grpo" and hyperparameters.get("scale_rewards") is False:
        estimator = "dr_grpo"
    name, k = _ESTIMATOR_TEXT.get(estimator, estimator), hyperparameters.get("num_generations", 1)
    kl = ("adds a KL term towards the reference to the loss" if estimator in ("grpo", "dr_grpo")
          else "subtracts a KL penalty towards the reference from the reward")
    return (f"clipped policy-gradient updates with {name} advantages over {k} responses per prompt (no critic) "
            "and a KL penalty towards a frozen reference",
            f"compares the {k} responses to each prompt ({name} advantages, no critic), {kl}, and takes several "
            "clipped policy updates on the batch")


def card_hyperparameters(args) -> dict:
    """The PPOConfig values the card lists (`CARD_HYPERPARAMETERS`), plus the per-device rollout batch and world size."""
    values = {name: getattr(args, name) for name in CARD_HYPERPARAMETERS}
    values["rollout_batch_size (per device)"] = args.rollout_batch_size
    values["world_size"] = args.world_size
    return values


def model_sources(model, reward_model, ref_model, policy_model, trained_adapter: str | None,
                  ref_adapter: str | None, fresh_adapter: bool) -> dict[str, str | None]:
    """How the card names the base, reward and reference models (ids as given; objects by `source_name`; a list of
    rewards as a list of names).

    An adapter given by id/path is named by its base, and is itself the reference; a reference adapter of a
    `PeftModel` object is named as such (never "the adapter disabled").
    """
    sources = {"model": _given_name(model),
               "reward_model": ([_given_name(r) for r in reward_model] if isinstance(reward_model, (list, tuple))
                                else _given_name(reward_model)),
               "ref_model": _given_name(ref_model)}
    if isinstance(model, str) and trained_adapter and not fresh_adapter:
        sources["model"] = policy_model.peft_config[trained_adapter].base_model_name_or_path
        sources["ref_model"] = sources["ref_model"] or model
    elif ref_adapter is not None:
        sources["ref_model"] = f"adapter {ref_adapter!r} of the policy"
    return sources


REWARD_FUNCTION = "reward function "  # how `source_name` names a callable reward (the space keeps it from a Hub id)


def _given_name(model) -> str | None:
    """A model's name as given: the id/path itself, else `source_name`."""
    return model if isinstance(model, str) else source_name(model)


def source_name(obj) -> str | None:
    """How the card names a model given as an object: its config's `_name_or_path`, else its class name; a reward
    function as `REWARD_FUNCTION` + its name (never mistaken for a Hub id)."""
    from torch import nn

    if obj is None:
        return None
    if callable(obj) and not isinstance(obj, nn.Module):
        return REWARD_FUNCTION + str(getattr(obj, "__name__", type(obj).__name__))
    model = getattr(obj, "pretrained_model", obj)  # a value-head wrapper names its body
    config = getattr(model, "config", None)
    return getattr(config, "_name_or_path", None) or type(obj).__name__


def write_policy_card(folder, policy, trained_adapter: str | None, sources: dict, args, log_history: list[dict], *,
                      repo_id: str, merged: bool, dataset_names: list[str], saved_locally: bool = False) -> bool:
    """Render the trained policy's card (and plot) into `folder`; return whether the policy is an adapter.

    `policy`: the policy model (a PeftModel when LoRA-trained); `sources`: {"model", "reward_model", "ref_model"}
    names as given to the trainer.
    """
    peft_config = policy.peft_config[trained_adapter].to_dict() if trained_adapter else None
    write_model_card(folder, repo_id=repo_id, base_model=sources["model"], reward_model=sources["reward_model"],
                     ref_model=sources["ref_model"], dataset_names=dataset_names, peft_config=peft_config,
                     hyperparameters=card_hyperparameters(args), log_history=log_history,
                     merged=merged or (saved_locally and peft_config is None), saved_locally=saved_locally)
    return peft_config is not None


# ---- Repo id ---------------------------------------------------------------------------------------------------------
def resolve_repo_id(hub_model_id: str | None, output_dir: str, token: str | None) -> str:
    """The Hub repo id to push to, resolved as `TrainingArguments`/`Trainer` do.

    `hub_model_id="namespace/name"` is used as is. Otherwise the name (`hub_model_id` without a namespace, else the
    name of `output_dir`'s folder) goes under the user the token belongs to (one `whoami` request; `token=None`
    uses the logged-in token). Raises `ValueError` naming the fix when the id is invalid or no user can be found.
    """
    from huggingface_hub.utils import validate_repo_id

    name = hub_model_id or Path(output_dir).absolute().name
    if "/" not in name:
        name = f"{_whoami(token, name)}/{name}"
    try:
        validate_repo_id(name)
    except ValueError as err:
        raise ValueError(
            f"{name!r} is not a valid Hub repo id ({err}). Set hub_model_id='your-user/model-name'."
        ) from err
    return name


def _whoami(token: str | None, name: str) -> str:
    from huggingface_hub import HfApi

    try:
        return HfApi().whoami(token=token)["name"]
    except Exception as err:  # no token, an invalid one, or no network: all need the same fix
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(
            f"Cannot tell which Hub repo to push to: hub_model_id does not name a namespace, and the Hub user "
            f"could not be found ({reason}). Set hub_model_id='your-user/{name}', or log in with `hf auth login` "
            f"(or pass hub_token) so that the repo goes under your user."
        ) from err


# ---- Model card ------------------------------------------------------------------------------------------------------
def write_model_card(
    folder,
    *,
    repo_id: str,
    base_model: str | None,
    reward_model: str | list[str] | None,
    ref_model: str | None,
    dataset_names: list[str],
    peft_config: dict | None,
    hyperparameters: dict,
    log_history: list[dict],
    merged: bool = False,
    saved_locally: bool = False,
) -> Path:
    """Render the policy's model card into `folder/README.md` and its plot into `folder/training_curves.png`.

    The card (template `model_cards/policy_card.md.jinja`) names the base, reward and reference models and the
    datasets, lists LoRA and PPO hyperparameters, the final and best-reward metrics from `log_history` (reward =
    `objective/scores`, KL = `objective/kl`, length = `rollout/response_length`), how to load the policy, framework
    versions and citations. Its YAML metadata holds `base_model`, `library_name` (`peft`, or `transformers` when
    `merged`), `tags` and `datasets`. Nothing local is written: model and dataset names that are not Hub ids
    become "a local model"/"a local dataset", and hyperparameters holding a path or a secret are left out.
    `saved_locally`: the card of a folder written by `save_model()` (not pushed yet); its "How to load" loads the
    folder itself, `merged` then meaning a standalone model (no adapter). Returns the path of README.md.
    """
    import jinja2
    from huggingface_hub import ModelCard, ModelCardData

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    plot = plot_training_curves(
        log_history,
        folder / PLOT_FILE,
        panels={key: label for key, label in CARD_METRICS[:2]},
        title=f"PPO training of {repo_id.split('/')[-1]}",
    )
    base_id, ref_id = _hub_id(base_model), _hub_id(ref_model)
    rewards = reward_model if isinstance(reward_model, (list, tuple)) else [reward_model]
    hub_datasets = [d for d in (_hub_id(name) for name in dataset_names) if d]
    card_data = ModelCardData(
        base_model=base_id,
        library_name="transformers" if merged else "peft",
        pipeline_tag="text-generation",
        tags=list(CARD_TAGS),
        datasets=hub_datasets or None,
        model_name=repo_id.split("/")[-1],
    )
    if ref_model is not None:
        reference_text = _model_text(ref_id, ref_model)
    elif peft_config is not None:
        reference_text = "the initial policy: the base model with the LoRA adapter disabled"
    else:
        reference_text = "the initial policy (a frozen copy of the base model)"
    metrics, last_step, best_step = _metric_rows(log_history)
    evaluation_step, evaluation = final_evaluation(log_history)
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True)
    content = env.from_string(_card_template()).render(
        card_data=card_data.to_yaml(),
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        merged=merged,
        saved_locally=saved_locally,
        base_model_text=_model_text(base_id, base_model),
        base_model_id=base_id or "<base model id>",
        reward_model_text=", ".join(dict.fromkeys(_model_text(_hub_id(r), r) for r in rewards)),
        reference_text=reference_text,
        datasets_text=_datasets_text(dataset_names),
        metrics=metrics,
        last_step=last_step,
        best_step=best_step,
        evaluation=evaluation,
        evaluation_step=evaluation_step,
        plot_file=PLOT_FILE if plot is not None else None,
        lora=_lora_rows(peft_config),
        hyperparameters=_public_rows(hyperparameters),
        method_text=method_texts(hyperparameters)[0],
        procedure_text=method_texts(hyperparameters)[1],
        versions=[(name, _version(name)) for name in FRAMEWORKS],
    )
    path = folder / "README.md"
    ModelCard(content).save(path)  # parsing it here fails fast on broken YAML metadata
    return path


def _card_template() -> str:
    """The card template: the source checkout's `model_cards/` when this module runs from one, else the package's.

    The checkout's copy wins so that an edited template is the one rendered even when another checkout is the
    installed (editable) one; a wheel has no `model_cards/` beside the package and reads `hf_ppo.model_cards`.
    """
    source = Path(__file__).resolve().parent.parent / "model_cards" / CARD_TEMPLATE
    if source.is_file():
        return source.read_text(encoding="utf-8")
    return resources.files("hf_ppo.model_cards").joinpath(CARD_TEMPLATE).read_text(encoding="utf-8")


def make_base_path_absolute(folder) -> str | None:
    """Make `folder/adapter_config.json` name its base model loadably from any working directory.

    PEFT records the base as it was given to `from_pretrained`: a relative local path then only resolves from the
    directory the run started in. A base that is a local folder is rewritten as its absolute path; a Hub id is kept.
    Returns the recorded base (None when `folder` holds no adapter).
    """
    path = Path(folder) / "adapter_config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    base = config.get("base_model_name_or_path")
    if base and not os.path.isabs(base) and os.path.isdir(base):
        config["base_model_name_or_path"] = base = os.path.abspath(base)
        path.write_text(json.dumps(config, indent=2, sort_keys=True))
    return base


def saved_policy_message(folder, is_adapter: bool) -> str:
    """What `save_model()` prints: where the policy is, how to load it (adapter or merged), how to push it."""
    folder = os.path.abspath(folder)
    name = Path(folder).name
    if is_adapter:
        load = [f"  load it:   from peft import AutoPeftModelForCausalLM; "
                f"model = AutoPeftModelForCausalLM.from_pretrained({folder!r})",
                "             (the base model is read from adapter_config.json; the tokenizer is in the same folder)",
                "  merged:    model = AutoPeftModelForCausalLM.from_pretrained(...).merge_and_unload(); "
                "model.save_pretrained('merged')"]
        what = "LoRA adapter, tokenizer and model card"
    else:
        load = [f"  load it:   from transformers import AutoModelForCausalLM; "
                f"model = AutoModelForCausalLM.from_pretrained({folder!r})"]
        what = "weights, tokenizer and model card"
    push = ["  push it:   trainer.push_to_hub() in the training script (push_to_hub: true in a recipe config), or "
            "from the folder:",
            f"             python -c \"from hf_ppo.hub import push_policy_folder; "
            f"push_policy_folder({folder!r}, 'your-user/{name}')\""]
    return "\n".join([f"Saved the policy ({what}) to {folder}", *load, *push])


def _looks_local(value: str) -> bool:
    """True when `value` reads as a path on this machine (absolute, home-relative, or an existing file/folder)."""
    value = value.strip()
    if not value:
        return False
    if os.path.isabs(value) or value.startswith(("~", "./", "../", ".\\")) or re.match(r"^[A-Za-z]:[\\/]", value):
        return True
    if str(Path.home()) in value:
        return True
    try:
        return os.sep in value and Path(value).exists()
    except OSError:
        return False


def _hub_id(value: str | None) -> str | None:
    """`value` when it is a Hub repo id and not a local folder; None otherwise (so no local path leaks)."""
    if not value:
        return None
    value = str(value)
    if _HUB_ID.match(value) and not _looks_local(value) and not Path(value).exists():
        return value
    return None


def _model_text(hub_id: str | None, given: str | None) -> str:
    if given and given.startswith(REWARD_FUNCTION):
        return f"a reward function (`{given[len(REWARD_FUNCTION):]}`)"
    if hub_id:
        return f"[{hub_id}](https://huggingface.co/{hub_id})"
    return "a local model" if given else "not recorded"


def _datasets_text(names: list[str]) -> str:
    shown = []
    for name in names:
        hub_id = _hub_id(name)
        shown.append(f"[{hub_id}](https://huggingface.co/datasets/{hub_id})" if hub_id else "a local dataset")
    return ", ".join(dict.fromkeys(shown)) or "not recorded"


def _contains_local(value) -> bool:
    if isinstance(value, str):
        return _looks_local(value)
    if isinstance(value, dict):
        return any(_contains_local(v) for v in value.values())
    if isinstance(value, (list, tuple, set)):
        return any(_contains_local(v) for v in value)
    return False


def _format_value(value) -> str:
    if isinstance(value, float):
        text = f"{value:.6g}"
    elif isinstance(value, (set, frozenset)):
        text = ", ".join(sorted(map(str, value)))
    elif isinstance(value, (list, tuple)):
        text = ", ".join(map(str, value))
    elif isinstance(value, dict):
        text = json.dumps(value, sort_keys=True, default=str)
    else:
        text = str(value)
    # A "|" would end the markdown table cell.
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`"


def _public_rows(values: dict | None) -> list[tuple[str, str]]:
    """(key, formatted value) rows safe to publish: secrets and anything naming a local path are dropped."""
    rows = []
    for key, value in (values or {}).items():
        if _SECRET_KEY.search(str(key)) or _contains_local(value):
            continue
        rows.append((str(key), _format_value(value)))
    return rows


def _lora_rows(peft_config: dict | None) -> list[tuple[str, str]]:
    if not peft_config:
        return []
    picked = {k: peft_config[k] for k in LORA_FIELDS if peft_config.get(k) is not None}
    return _public_rows(picked)


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.4g}"


def _metric_rows(log_history: list[dict]) -> tuple[list[dict], int | None, int | None]:
    """Rows (final, at the best-reward step, min, max) for each logged card metric; plus last and best step."""
    series = {key: metric_series(log_history, key) for key, _ in CARD_METRICS}
    series = {key: s for key, s in series.items() if s[0]}
    if not series:
        return [], None, None
    last_step = max(steps[-1] for steps, _ in series.values())
    best_step = None
    reward_key = CARD_METRICS[0][0]
    if reward_key in series:
        steps, values = series[reward_key]
        best_step = steps[max(range(len(values)), key=values.__getitem__)]
    rows = []
    for key, label in CARD_METRICS:
        if key not in series:
            continue
        steps, values = series[key]
        at_best = dict(zip(steps, values)).get(best_step) if best_step is not None else None
        rows.append({"label": label, "final": _fmt(values[-1]), "at_best": _fmt(at_best),
                     "min": _fmt(min(values)), "max": _fmt(max(values))})
    return rows, last_step, best_step


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "source checkout" if package == "hf_ppo" else "not installed"


# ---- Push ------------------------------------------------------------------------------------------------------------
def push_policy_folder(
    folder,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    commit_message: str = "Upload PPO policy",
) -> str:
    """Upload the policy files of `folder` (see `POLICY_ALLOW_PATTERNS`) to the Hub model repo `repo_id`.

    Creates the repo if needed (`private` only applies then, as on the Hub), creates branch `revision` from main
    when given, and commits the policy files in one commit (to a new pull request with `create_pr=True`, which
    targets main). Value head, reference/reward weights, optimizer/scheduler/RNG state and `training_args.bin` are
    never uploaded. Returns the commit url (a `huggingface_hub.CommitInfo`, a str with `.oid` and `.pr_url`).

    Raises `ValueError` before any request when `folder` holds no policy weights or when `create_pr` is combined
    with a branch; `HubPushError` when the Hub cannot be reached or refuses the push. `folder` is only read.
    """
    from huggingface_hub.utils import filter_repo_objects

    folder = Path(folder)
    files = policy_files(folder) if folder.is_dir() else []
    if not list(filter_repo_objects(files, allow_patterns=_WEIGHT_PATTERNS)):
        raise ValueError(
            f"{folder} holds no policy weights (adapter_model.safetensors or model*.safetensors): nothing to push. "
            "Save the policy there first (trainer.save_model())."
        )
    branch = revision if revision not in (None, "main") else None
    if create_pr and branch is not None:
        raise ValueError(
            f"create_pr=True opens a pull request against main, so it cannot be combined with "
            f"hub_revision={revision!r}: set one of them."
        )
    _warn_on_local_base_path(folder)
    return _upload(folder, repo_id, "the policy", POLICY_ALLOW_PATTERNS, list(POLICY_IGNORE_PATTERNS),
                   f"The local output in {folder} is intact (a push only reads it): fix the cause, then retry with "
                   "trainer.push_to_hub(); no retraining is needed.",
                   token=token, private=private, branch=branch, create_pr=create_pr, commit_message=commit_message)


def _upload(folder, repo_id: str, what: str, allow_patterns: list[str], ignore_patterns: list[str] | None,
            retry: str, *, token: str | None, private: bool | None, branch: str | None = None,
            create_pr: bool = False, commit_message: str, delete_patterns: list[str] | None = None):
    """Create `repo_id` if needed (and branch `branch` from main), then commit the allowed files of `folder` in one
    commit. Any failure is a `HubPushError` naming `what` was pushed, the cause, and `retry` (what to do next)."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if branch is not None:
            api.create_branch(repo_id, branch=branch, exist_ok=True)
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            allow_patterns=allow_patterns,
            ignore_patterns=ignore_patterns,  # a fresh list: upload_folder appends its defaults in place
            delete_patterns=delete_patterns,
            revision=branch,
            create_pr=create_pr,
            commit_message=commit_message,
        )
    except Exception as err:
        raise _push_error(what, repo_id, err, api.endpoint, retry) from err


def _push_error(what: str, repo_id: str, err: Exception, endpoint: str, retry: str) -> HubPushError:
    return HubPushError(f"Could not push {what} to the Hub repo {repo_id!r}: {_describe_failure(err, endpoint)}. "
                        f"{retry}")


def _warn_on_local_base_path(folder: Path) -> None:
    # PEFT writes the base model's `_name_or_path` into adapter_config.json; a local path there is published
    # as is (the file is uploaded byte for byte) and makes `AutoPeftModel.from_pretrained(repo_id)` fail elsewhere.
    config_path = folder / "adapter_config.json"
    if not config_path.is_file():
        return
    base = json.loads(config_path.read_text()).get("base_model_name_or_path")
    if base and _hub_id(base) is None:
        logger.warning(
            "adapter_config.json names a local base model (base_model_name_or_path is a path on this machine); it is "
            "uploaded as is. Set it to the base model's Hub id before saving to make the adapter loadable by id."
        )


def _describe_failure(err: Exception, endpoint: str) -> str:
    from huggingface_hub.errors import HfHubHTTPError

    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if isinstance(err, HfHubHTTPError) and err.response is not None:
        status = err.response.status_code
        if status in (401, 403):
            return (f"the Hub refused the credentials (HTTP {status}); log in with `hf auth login` or pass a "
                    "hub_token with write access to this repo")
        if status >= 500:
            return f"the Hub answered with a server error (HTTP {status}), usually temporary"
        return f"the Hub answered HTTP {status} ({first_line})"
    if isinstance(err, ValueError):
        return f"the Hub rejected the upload ({first_line})"
    return (f"the Hub at {endpoint} could not be reached ({type(err).__name__}: {first_line}); "
            "check the network connection and HF_ENDPOINT")


def save_policy_folder(policy, output_dir: str, trained_adapter: str | None, tokenizer,
                       state_dict: dict | None = None) -> None:
    """The policy alone (full weights, or only the trained adapter) + tokenizer, loadable from any directory.

    The adapter names its base as a Hub id or an absolute path, and PEFT's placeholder README.md is not left behind:
    `save_model()` and `push_to_hub()` write the real card.
    """
    os.makedirs(output_dir, exist_ok=True)
    card = os.path.join(output_dir, "README.md")
    had_card = os.path.isfile(card)
    save_policy(policy, output_dir, trained_adapter, state_dict)
    tokenizer.save_pretrained(output_dir)
    make_base_path_absolute(output_dir)
    if not had_card and os.path.isfile(card):
        os.remove(card)


# ---- A critic, to a repo of its own ----------------------------------------------------------------------------------
# What a critic push may upload, and replace on a later push: what `save_critic` writes, and the card.
CRITIC_PATTERNS: list[str] = [CRITIC_STATE_FILE, CRITIC_INFO_FILE, "critic/adapter_config.json",
                              "critic/adapter_model.safetensors", *MODEL_PATTERNS, *TOKENIZER_PATTERNS, "README.md"]


def push_critic(model, repo_id: str, tokenizer=None, *, private: bool | None = None, token: str | None = None,
                commit_message: str = "Upload hf_ppo critic") -> str:
    """Push the critic of `model` to the Hub model repo `repo_id`, a repo of its own: the files `save_critic` writes
    (written to a temporary folder) and a card saying which critic it is, its base and how to load it
    (`critic_model="<repo_id>"`). No policy weights: `save_critic` writes none. A repo holding files that no critic
    push wrote (a policy's) is refused before anything is uploaded; a critic pushed there before is replaced (its
    files that the new critic lacks are deleted; files the user added stay). Returns the commit url (a
    `huggingface_hub.CommitInfo`); a failed push raises `HubPushError`."""
    import tempfile

    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    validate_repo_id(repo_id)
    retry = ("Nothing local changed: fix the cause, then push again (model.push_critic_to_hub, or trainer.push_to_hub "
             "with critic_hub_model_id); no retraining is needed.")
    api = HfApi(token=token)
    try:
        existing = api.list_repo_files(repo_id)
    except RepositoryNotFoundError:
        existing = []  # a new repo (or one this token cannot see: creating it says which)
    except Exception as err:
        raise _push_error("the critic", repo_id, err, api.endpoint, retry) from err
    foreign = [f for f in existing if f != ".gitattributes"]
    if foreign and CRITIC_INFO_FILE not in existing:
        raise ValueError(f"The Hub repo {repo_id!r} holds files no critic push wrote ({', '.join(foreign[:3])}"
                         f"{', ...' if len(foreign) > 3 else ''}): a critic never goes into a policy's repo. Push the "
                         f"critic to a repo of its own, e.g. '{repo_id}-critic'.")
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_critic(model, os.path.join(tmp, "critic"), tokenizer)
        info = json.loads(Path(folder, CRITIC_INFO_FILE).read_text())
        base = info["base"] if info["base"] is not None else getattr(model.config, "_name_or_path", None)
        if base and _hub_id(base) is None:
            logger.warning("The critic's base model is a local path (%s): the pushed critic loads only where that "
                           "path exists. Start the critic from a Hub id to make it loadable anywhere.", base)
        write_critic_card(folder, repo_id, info["critic"], base)
        return _upload(folder, repo_id, "the critic", CRITIC_PATTERNS, None, retry, token=token, private=private,
                       commit_message=commit_message, delete_patterns=CRITIC_PATTERNS)


def push_run_critic(model, tokenizer, args, policy_repo_id: str, token: str | None):
    """`trainer.push_to_hub()`'s critic push: to `args.critic_hub_model_id` when set (else nothing), never to the
    policy's repo `policy_repo_id` (resolved, so a hub_model_id without a namespace is compared as pushed)."""
    repo_id = args.critic_hub_model_id
    if repo_id is None:
        return None
    if repo_id == policy_repo_id:
        raise ValueError(f"critic_hub_model_id={repo_id!r} is the policy's repo: the critic goes to a repo of its own, "
                         f"e.g. critic_hub_model_id='{repo_id}-critic'.")
    return push_critic(model, repo_id, tokenizer, private=args.hub_private_repo, token=token)


def write_critic_card(folder, repo_id: str, critic: str, base: str | None) -> Path:
    """The critic's README.md: an hf_ppo critic, which `critic` kind, its base model, how to load it."""
    from huggingface_hub import ModelCard, ModelCardData

    full = critic == "separate" and Path(folder, "config.json").is_file()
    lora = critic != "shared" and not full
    base_id = _hub_id(base)
    card_data = ModelCardData(base_model=base_id, library_name="peft" if lora else None,
                              tags=[*CARD_TAGS, "critic", "value-model"], model_name=repo_id.split("/")[-1])
    holds = {"shared": "a value head (`hidden -> 1`) that reads the hidden states of the policy it was trained beside",
             "separate": "a LoRA adapter (in `critic/`, PEFT's layout) + value head on its base" if lora else
             "a fully fine-tuned critic, also a one-label `AutoModelForSequenceClassification` (the value head is its "
             "score layer; the head's bias is only in `critic.safetensors`)",
             "reward_lora": "a LoRA adapter (in `critic/`, PEFT's layout) + value head on the reward model's base"}
    carries = {"shared": "The value head reads the policy's body: its values carry over only to the same policy "
                         "weights (the policy it was trained beside, its adapter included).",
               "separate": "It carries over to any policy with the same tokenizer.",
               "reward_lora": "Pass the same reward model: the adapter sits on it, and the reward scores with the "
                              "adapter disabled."}
    content = f"""---
{card_data.to_yaml()}
---

# {repo_id.split("/")[-1]}

The critic (value model) of a PPO run trained with hf_ppo: `critic="{critic}"`, {_CRITIC_TEXT[critic]}. It holds
{holds[critic]}. It is not a policy: it predicts a value per response token for GAE, and generates nothing.

- Base model: {_model_text(base_id, base)}
- Files: `{CRITIC_STATE_FILE}` (the critic's state, exactly as a checkpoint stores it) and `{CRITIC_INFO_FILE}` (which
  critic it is, and its base)

## How to load

Start a new run's critic from it, with the same `critic` setting:

```python
from hf_ppo import PPOConfig, PPOLMTrainer

args = PPOConfig(..., critic="{critic}")
trainer = PPOLMTrainer(model=..., args=args, reward_model=..., critic_model="{repo_id}")
```

hf_ppo rebuilds the critic as the saved run did and loads `{CRITIC_STATE_FILE}` into it: its values are bitwise the
pushed critic's. {carries[critic]}
"""
    path = Path(folder) / "README.md"
    ModelCard(content).save(path)  # parsing it here fails fast on broken YAML metadata
    return path
