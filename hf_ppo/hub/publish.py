"""Publishing the trained policy: which files leave the machine, the model card, and the push itself.

Only the policy is published to the policy's repo: the LoRA adapter (or the merged model), its tokenizer, the card
and its plot. The value head, the reference and reward models, optimizer/scheduler/RNG state and `training_args.bin`
stay local, enforced twice: an allow-list of policy file names and a deny-list for everything training leaves
beside them. A push only reads the output folder, so a failed push loses nothing and can simply be retried.
A critic is published only on request, to a repo of its own (`push_critic`): what `save_critic` writes, and its card.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

from ..models import gguf
from ..models.adapters import save_policy
from ..models.pretrained import _quantization_of
from ..runtime.warn import warn_user, without_checkpointing_deprecation
from ..models.critics import CRITIC_INFO_FILE, CRITIC_STATE_FILE, save_critic
from .cards import PublishSettings, _hub_id, is_hf_ppo_card, write_critic_card

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


class HubPushError(RuntimeError):
    """A push to the Hub (of the policy, or of a critic) failed; nothing local changed and the push can be retried."""


# ---- Which files are the policy ------------------------------------------------------------------------------------
def published_policy_files(folder) -> list[str]:
    """The paths (relative, POSIX) in `folder` that `push_policy_folder` would upload, sorted."""
    from huggingface_hub.utils import filter_repo_objects

    folder = Path(folder)
    paths = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    return sorted(filter_repo_objects(paths, allow_patterns=POLICY_ALLOW_PATTERNS,
                                      ignore_patterns=POLICY_IGNORE_PATTERNS))


# ---- Merged export ---------------------------------------------------------------------------------------------------
@without_checkpointing_deprecation
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


def load_lines(source: str, is_adapter: bool) -> list[str]:
    """How to load a policy saved or pushed to `source` (a folder or a Hub id): a LoRA adapter with peft's
    `AutoPeftModelForCausalLM` (its base read from adapter_config.json), full weights (a run without LoRA, or an
    adapter merged by `push_merged_model`) with transformers' `AutoModelForCausalLM`."""
    if is_adapter:
        return [f"  load it:   from peft import AutoPeftModelForCausalLM; "
                f"model = AutoPeftModelForCausalLM.from_pretrained({source!r})",
                "             (the base model is read from adapter_config.json; the tokenizer is in the same place)",
                "  merged:    model = AutoPeftModelForCausalLM.from_pretrained(...).merge_and_unload(); "
                "model.save_pretrained('merged')"]
    return [f"  load it:   from transformers import AutoModelForCausalLM; "
            f"model = AutoModelForCausalLM.from_pretrained({source!r})"]


def pushed_policy_message(repo_id: str, commit, local_folder, is_adapter: bool) -> str:
    """What `hf-ppo train` prints after `push_to_hub`: the repo and commit, the local copy, how to load what was
    pushed (`load_lines`: an adapter, or full weights)."""
    return "\n".join([f"Pushed the policy to {repo_id} ({getattr(commit, 'commit_url', commit)}); local copy in "
                      f"{local_folder}.", *load_lines(repo_id, is_adapter)])


def saved_policy_message(folder, is_adapter: bool) -> str:
    """What `save_model()` prints: where the policy is, how to load it (adapter or merged), how to push it."""
    folder = os.path.abspath(folder)
    name = Path(folder).name
    load = load_lines(folder, is_adapter)
    what = "LoRA adapter, tokenizer" if is_adapter else "weights, tokenizer"
    # A README.md of the user's own is kept, and no card written (cards.write_model_card says so).
    what += " and model card" if is_hf_ppo_card(os.path.join(folder, "README.md")) else ""
    push = ["  push it:   trainer.push_to_hub() in the training script (push_to_hub: true in a recipe config), or "
            "from the folder:",
            f"             python -c \"from hf_ppo.hub import push_policy_folder; "
            f"push_policy_folder({folder!r}, 'your-user/{name}')\""]
    return "\n".join([f"Saved the policy ({what}) to {folder}", *load, *push])


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
    base_model_id: str | None = None,
) -> str:
    """Upload the policy files of `folder` (see `POLICY_ALLOW_PATTERNS`) to the Hub model repo `repo_id`.

    Creates the repo if needed (`private` only applies then, as on the Hub), creates branch `revision` from main
    when given, and commits the policy files in one commit (to a new pull request with `create_pr=True`, which
    targets main). Value head, reference/reward weights, optimizer/scheduler/RNG state and `training_args.bin` are
    never uploaded. Returns the commit url (a `huggingface_hub.CommitInfo`, a str with `.oid` and `.pr_url`).

    An adapter whose base is a local path (a local folder, a GGUF file's conversion) is uploaded naming
    `base_model_id` as its base instead (default: `hub_base_model_id` as recorded in `RUN_RECORD_FILE`), so that it
    loads by id on any machine; the local adapter_config.json keeps the base it was trained on. Without one, a
    warning names both fixes (`hub_base_model_id`, `push_merged_model`).

    Raises `ValueError` before any request when `folder` holds no policy weights or when `create_pr` is combined
    with a branch; `HubPushError` when the Hub cannot be reached or refuses the push. `folder` is only read.
    """
    from huggingface_hub.utils import filter_repo_objects

    folder = Path(folder)
    files = published_policy_files(folder) if folder.is_dir() else []
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
    record = read_run_record(folder) or {}
    base_model_id = base_model_id or (record.get("base_model") or {}).get("hub_id")
    retry = (f"The local output in {folder} is intact (a push only reads it): fix the cause, then retry with "
             "trainer.push_to_hub(); no retraining is needed.")
    config = _adapter_config_for_hub(folder, base_model_id, record)
    with tempfile.TemporaryDirectory(prefix="hf_ppo_push_") if config else contextlib.nullcontext(folder) as upload:
        if config:  # a copy of the policy files whose adapter_config.json names the Hub base
            for name in files:
                Path(upload, name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(folder / name, Path(upload, name))
            Path(upload, "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        return _upload(upload, repo_id, "the policy", POLICY_ALLOW_PATTERNS, list(POLICY_IGNORE_PATTERNS), retry,
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


def _adapter_config_for_hub(folder: Path, base_model_id: str | None, record: dict) -> dict | None:
    """The adapter_config.json to upload in place of `folder`'s when the adapter's base is a local path (a local
    folder, a GGUF file's conversion) and `base_model_id` names its Hub id; None to upload the folder as it is. An
    adapter left naming a local base is warned about, with both fixes."""
    config_path = folder / "adapter_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    base = config.get("base_model_name_or_path")
    if not base or _hub_id(base) is not None:
        return None
    if base_model_id is not None:
        return {**config, "base_model_name_or_path": base_model_id}
    # PEFT writes the base model's `_name_or_path` into adapter_config.json; a local path there would be published as
    # is and make `AutoPeftModel.from_pretrained(repo_id)` fail on every other machine.
    gguf_file = (record.get("base_model") or {}).get("gguf_file")
    origin = (f"the conversion of the GGUF file {gguf_file!r} (hf_ppo's cache)" if gguf_file
              else "a path on this machine")
    warn_user(f"The adapter pushed from {folder} names as its base {origin}: {base}. It loads only on this machine. "
              "Set hub_base_model_id to the base model's Hub id (PPOConfig, or `hub_base_model_id:` in a recipe "
              "config; for a GGUF file, the model it was made from, e.g. 'HuggingFaceTB/SmolLM2-135M-Instruct'), or "
              "push the merged model instead (push_merged_model=True), a standalone model that needs no base.")
    return None


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
                       state_dict: dict | None = None, record: dict | None = None) -> None:
    """The policy alone (full weights, or only the trained adapter) + tokenizer, loadable from any directory, and
    `record` (`run_record`) as `RUN_RECORD_FILE` when given.

    The adapter names its base as a Hub id or an absolute path, and PEFT's placeholder README.md is not left behind:
    `save_model()` and `push_to_hub()` write the real card.
    """
    os.makedirs(output_dir, exist_ok=True)
    card = os.path.join(output_dir, "README.md")
    had_card = os.path.isfile(card)
    # PEFT's save_pretrained updates an existing README.md's metadata in place: a README the user keeps there (which
    # the card writer then leaves alone) must come out byte for byte as it went in.
    kept = Path(card).read_bytes() if had_card else None
    save_policy(policy, output_dir, trained_adapter, state_dict)
    if kept is not None and Path(card).read_bytes() != kept:
        Path(card).write_bytes(kept)
    tokenizer.save_pretrained(output_dir)
    make_base_path_absolute(output_dir)
    if record is not None:
        Path(output_dir, RUN_RECORD_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    if not had_card and os.path.isfile(card):
        os.remove(card)


# ---- What the run loaded, beside the policy --------------------------------------------------------------------------
# Written by save_model() beside the policy, never published: how the run loaded each model (so `hf-ppo evaluate`
# compares against the reference as trained against) and where the policy's base came from (a GGUF file, the Hub id
# a pushed adapter names).
RUN_RECORD_FILE = "hf_ppo_run.json"


def run_record(settings: PublishSettings, sources: dict, policy_model, ref_model, ref_adapter: str | None,
               reward_model, *, chat_prompts: bool | None = None, global_step: int | None = None) -> dict:
    """What `save_model()` records beside the policy (`RUN_RECORD_FILE`):

    - `quantization`: {"policy", "reference", "reward"} as the run loaded them ('4bit', '8bit', 'none'; the
      reward a list, one per reward model or function, None for a function). The reference is the policy's base
      (its adapter disabled, or a reference adapter on it) when `ref_model` is None, so it has the policy's;
    - `reference`: the reference model as given (id or path), or None when it lives inside the policy;
    - `base_model`: the policy's origin: `source` (the id or path given), `gguf_file` (None unless it is a GGUF
      checkpoint), `hub_id` (PPOConfig.hub_base_model_id: what a pushed adapter names as its base);
    - `precision`: the compute dtype the run loaded its models in: 'bf16', 'fp16' or 'fp32' (`bf16` / `fp16`);
    - `prompts`: how the prompts were made: `column` (PPOConfig.prompt_column; None: the dataset's 'prompt',
      'messages' or 'input_ids'), `system_prompt`, `apply_chat_template_to_text`, and `format`, 'chat' when they went
      through the chat template (`chat_prompts`), else 'text' (None: not known), and `max_prompt_length` (the
      left-truncation of long prompts; None: none);
    - `sampling`: the run's `SamplingSettings` as it is (`response_length`, `temperature`, `top_k`, `top_p`, ...,
      `forward_batch_size`, `rollout_engine`), and what ended a response: `stop_token` ('eos' or None) and
      `stop_token_ids` (None: `stop_token` decides);
    - `scoring`: `reward_input_format`, how the reward models read (prompt, response);
    - `global_step`: the optimizer steps the saved policy was trained for (None: not known);
    - `dataset` (added by `hf-ppo train` after the save, `record_dataset`: the trainer does not know the names):
      `name`, `config`, `train_split`, `test_split` (a split name, a file, or None).
    A record written before a key existed lacks it: readers take that as "not recorded".
    """
    policy_q = _quantization_of(policy_model)
    rewards = reward_model if isinstance(reward_model, (list, tuple)) else [reward_model]
    reward_q = [_quantization_of(r) if hasattr(r, "parameters") else None for r in rewards]
    source, init = gguf.split_gguf_path(sources["model"], settings.model_init_kwargs)
    return {
        "format": 1,
        "quantization": {"policy": policy_q, "reference": _quantization_of(ref_model) if ref_model is not None
                         else policy_q, "reward": reward_q},
        "reference": sources.get("ref_model") if ref_model is not None else (
            f"adapter {ref_adapter!r} of the policy" if ref_adapter is not None else None),
        "base_model": {"source": source, "gguf_file": (init or {}).get("gguf_file"),
                       "hub_id": settings.hub_base_model_id},
        "precision": settings.precision,
        "prompts": {"column": settings.prompt_column, "system_prompt": settings.system_prompt,
                    "apply_chat_template_to_text": settings.apply_chat_template_to_text,
                    "format": None if chat_prompts is None else "chat" if chat_prompts else "text",
                    "max_prompt_length": settings.max_prompt_length},
        "sampling": {**asdict(settings.sampling), "stop_token": settings.stop_token,
                     "stop_token_ids": None if settings.stop_token_ids is None else list(settings.stop_token_ids)},
        "scoring": {"reward_input_format": settings.reward_input_format},
        "global_step": global_step,
    }


def record_dataset(folder, name: str, config: str | None, train_split: str, test_split: str | None) -> None:
    """Add the prompt dataset the run trained on to the `RUN_RECORD_FILE` that `save_model()` wrote in `folder`, so
    `hf-ppo evaluate` defaults to the split the run held out: `name` (a Hub id, or a local path as the run resolved
    it), `config`, `train_split`, `test_split` (a split of `name`, a file of its own, or None). A folder without a
    record (none was written there) is left alone."""
    record = read_run_record(folder)
    if record is None:
        return
    record["dataset"] = {"name": name, "config": config, "train_split": train_split, "test_split": test_split}
    path = Path(folder, RUN_RECORD_FILE)
    staged = path.with_name(path.name + ".tmp")  # replaced whole: a failed write leaves the record as it was
    staged.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    os.replace(staged, path)


def superseded_files(folder, adapter: bool) -> tuple[str, ...]:
    """The policy files an earlier hf_ppo save left in `folder` (its run record there says hf_ppo saved it) under
    names a save of the other kind does not write, so that save would leave them behind: a full model's weights
    beside a LoRA adapter (a push uploads them, and from_pretrained loads them as the model), or an adapter beside
    full weights. `adapter`: whether the new save is an adapter. None of a folder hf_ppo never saved into."""
    if not Path(folder, RUN_RECORD_FILE).is_file():
        return ()
    if adapter:
        names = ["model.safetensors", "model.safetensors.index.json"]
        try:
            index = json.loads(Path(folder, "model.safetensors.index.json").read_text())
            names += sorted({str(name) for name in index["weight_map"].values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # no index (one file), or not one hf_ppo can read: its shards are not named
    else:
        names = ["adapter_model.safetensors", "adapter_config.json"]
    return tuple(name for name in names if Path(folder, name).is_file())


def read_run_record(folder) -> dict | None:
    """The `RUN_RECORD_FILE` of a saved policy folder; None when there is none (a policy saved by another tool, or
    a Hub id) or it cannot be read: a record that is there but not a readable JSON object (truncated, edited) is
    said, since what it held (the run's reference, stop tokens, prompt format) is then not used."""
    path = Path(folder, RUN_RECORD_FILE)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        problem = f"cannot be read ({type(err).__name__}: {str(err)[:120]})"
    else:
        if isinstance(record, dict):
            return record
        problem = f"holds a JSON {type(record).__name__}, not the object hf_ppo writes"
    warn_user(f"{path} {problem}: it is ignored, so what the run recorded there (its reference, stop tokens, prompt "
              "format, dataset) is not used, and hf-ppo evaluate falls back to its own defaults. Save the policy "
              "again (trainer.save_model()) to write it anew, or pass those settings explicitly.")
    return None


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
    retry = ("Nothing local changed: fix the cause, then push again (trainer.push_critic_to_hub, or trainer.push_to_hub "
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


def push_run_critic(model, tokenizer, repo_id: str | None, policy_repo_id: str, *, private: bool | None,
                    token: str | None):
    """`trainer.push_to_hub()`'s critic push: to `repo_id` (the run's `critic_hub_model_id`) when set (else nothing),
    never to the policy's repo `policy_repo_id` (resolved, so a hub_model_id without a namespace is compared as
    pushed)."""
    if repo_id is None:
        return None
    if repo_id == policy_repo_id:
        raise ValueError(f"critic_hub_model_id={repo_id!r} is the policy's repo: the critic goes to a repo of its own, "
                         f"e.g. critic_hub_model_id='{repo_id}-critic'.")
    return push_critic(model, repo_id, tokenizer, private=private, token=token)
