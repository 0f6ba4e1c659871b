"""`SavingSeams`: what leaves `PPOLMTrainer` (`trainer/ppo_trainer.py`), through Trainer's own saving and hub seams.

Saving writes the policy alone (`hub.publish.save_policy_folder`: the adapter or the weights, the tokenizer and the
run record `hf-ppo evaluate` reads): a final save is written aside and moved in (`checkpoint.staged_save`), so a full
disk leaves an earlier save whole; a checkpoint adds the critic and the PPO state first, then Trainer's files, last
`trainer_state.json` (`trainer/checkpoint.py`: complete or invisible). Publishing pushes the policy folder alone with
its model card (`hub/`), the critic only to a repo of its own. A mixin of `PPOLMTrainer` (as `StepAPI` is), so its
`super()` is Trainer's.
"""

from __future__ import annotations

import contextlib
import functools
import os

from transformers import TrainerState
from transformers.trainer_utils import TrainOutput

from ..hub import cards, publish
from ..runtime import sharding
from ..runtime.warn import warn_user
from . import checkpoint, run_lock, watch
from .guard import check_finite_weights


class SavingSeams:
    """`PPOLMTrainer`'s saving and publishing: Trainer's `_save`, `save_model`, `save_state`, `_save_checkpoint`,
    `init_hf_repo`, `_push_from_checkpoint`, `push_to_hub` and `create_model_card`, plus `push_critic_to_hub`."""

    _checkpoint_being_written: str | None = None  # the folder `_save_checkpoint` writes right now (`_save` reads it)
    _output_dir_held = False  # inside `_holding_output_dir`

    # ---- one run per output_dir, until its final save is complete (trainer/run_lock.py) ---------------------------
    @contextlib.contextmanager
    def _holding_output_dir(self, every_process: bool = True):
        """Hold `output_dir` for the body (`run_lock.holding`): the whole of `train()`, and a final save into it, so
        that no other run starts between a run's training and its final save (`hf-ppo train` holds it across both).
        A hold inside a hold takes nothing again, nor does one while this trainer's own step() loop holds the folder.
        `every_process`: every process enters it (the main one's refusal broadcast to all); False: this process alone
        (a save, which the saving process alone runs)."""
        if self._output_dir_held:
            yield
            return
        if every_process:
            held = self._steps_hold_output_dir and self._step_lock_refusal() is None
            hold = run_lock.holding(self.args.output_dir, self.is_world_process_zero(), self._as_on_main_process,
                                    held=held)
        else:
            held = self._steps_hold_output_dir and run_lock.still_held(self._step_lock, self.args.output_dir) is None
            hold = run_lock.holding(self.args.output_dir, True, held=held)
        with hold:
            self._output_dir_held = True
            try:
                yield
            finally:
                self._output_dir_held = False

    def _finished_run(self, resume_from_checkpoint) -> TrainOutput | None:
        """A resume from a checkpoint that already reached max_steps (the run finished, then its final save failed or
        was killed: the resume hf_ppo's messages advise): nothing is trained (Trainer would train a step past
        max_steps), the checkpoint's policy, critic and state are loaded, and the final save writes them. Trainer's
        `TrainOutput`; None for any other resume (`checkpoint.finished_run`)."""
        found = None
        if self.is_world_process_zero() and not self.is_fsdp_enabled:  # (FSDP: Trainer's own path, as before)
            found = checkpoint.finished_run(self.args.output_dir, resume_from_checkpoint, self.args.max_steps,
                                            self.args.save_total_limit, self.args.should_save)
        found = self._as_on_main_process(found)
        if found is None:
            return None
        folder, step = found
        sharding.reinstate_accelerate_state(self._accelerate_state)
        self._load_from_checkpoint(folder)
        self.state = TrainerState.load_from_json(os.path.join(folder, checkpoint.TRAINER_STATE_FILE))
        warn_user(f"{folder} finished this run already (step {step}, max_steps {self.args.max_steps}): nothing is "
                  "trained; its policy and state are loaded, and the final save (save_model) writes them. To train "
                  "further, raise max_steps.")
        return TrainOutput(self.state.global_step, 0.0, {})

    # ---- saving: the policy alone; checkpoints add the value head and PPO state ------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        wrapper = self.accelerator.unwrap_model(self.model)  # under FSDP, `state_dict` holds the gathered policy
        check_finite_weights(wrapper, output_dir, self._last_complete_checkpoint())
        # How the run loaded each model, beside the policy: hf-ppo evaluate reads it.
        record = publish.run_record(self.args.publish_settings, self._model_sources, wrapper.policy_model, self.ref_model,
                                    self.ref_adapter, self.reward_model, chat_prompts=self._chat_prompts,
                                    global_step=self.state.global_step)
        # A final save is written aside and moved in, so a full disk leaves an earlier save whole and names the cause
        # (`checkpoint.staged_save`); a checkpoint's is complete or invisible already (`_save_checkpoint`).
        size = functools.partial(checkpoint.policy_bytes, wrapper.policy_model, self.trained_adapter, state_dict)
        in_checkpoint = os.path.abspath(output_dir) == os.path.abspath(self._checkpoint_being_written or "")
        # A final save into output_dir holds it (no other run starts before the save is whole: `_holding_output_dir`);
        # the run record moves in last, after the weights it describes.
        run_dir = os.path.abspath(self.args.output_dir)
        into_run = os.path.commonpath([run_dir, os.path.abspath(output_dir)]) == run_dir
        with contextlib.ExitStack() as stack:
            if not in_checkpoint and into_run:
                stack.enter_context(self._holding_output_dir(every_process=False))
            superseded = () if in_checkpoint else publish.superseded_files(output_dir, self.trained_adapter is not None)
            folder = output_dir if in_checkpoint else stack.enter_context(
                checkpoint.staged_save(output_dir, self.args.output_dir, size, last=(publish.RUN_RECORD_FILE,),
                                       superseded=superseded))
            publish.save_policy_folder(wrapper.policy_model, folder, self.trained_adapter, self.processing_class,
                                       state_dict, record)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the policy (see `_save`); called by the user, also write its model card (the Hub card's template) and
        print once, on the main process, the folder, how to load the policy (adapter or merged) and how to push it."""
        if self.is_fsdp_enabled:  # Trainer saves no policy from a sharded model: rank 0 writes the gathered weights
            with sharding.gathered_policy(self.model) as state_dict:
                self._save(output_dir, state_dict)
        else:
            super().save_model(output_dir, _internal_call)
        if _internal_call or not self.args.should_save:
            return
        folder = output_dir if output_dir is not None else self.args.output_dir
        is_adapter = self._write_card(folder, os.path.basename(os.path.abspath(folder)), merged=False, dataset_names=[],
                                      saved_locally=True)
        if self.is_world_process_zero():
            print(publish.saved_policy_message(folder, is_adapter))

    def save_state(self) -> None:
        """Trainer's (every logged metric, in output_dir/trainer_state.json); a failed write is named as a failed
        `save_model` is (`checkpoint.save_failures_named`)."""
        with checkpoint.save_failures_named(self.args.output_dir, self.args.output_dir,
                                            "the training log (trainer_state.json)", "The checkpoints are intact",
                                            call="trainer.save_state(), then trainer.save_model(),"):
            super().save_state()

    def _save_checkpoint(self, model, trial) -> None:
        """The PPO state first, then Trainer's files: Trainer writes trainer_state.json last and rotates only after
        it, so a folder with a readable trainer_state.json is complete (see trainer/checkpoint.py)."""
        if watch.stopped_by_collapse(self.callback_handler.callbacks):  # save_strategy='best' decides after on_log
            return
        run_dir = self._get_output_dir(trial=trial)
        folder = checkpoint.checkpoint_folder(run_dir, self.state.global_step)
        # A write that fails (a full disk) is one error naming the folder, its disk and the last complete checkpoint.
        written = functools.partial(checkpoint.write_failures_named, folder, run_dir)
        with written(), sharding.gathered(self.model):  # On every process, so all of them stop together.
            check_finite_weights(self.accelerator.unwrap_model(self.model), folder, self._last_complete_checkpoint())
            if self.args.should_save:
                wrapper = self.accelerator.unwrap_model(self.model)
                schedule = self._schedule if self._schedule is not None and not self._schedule.done else None
                checkpoint.save_trainer_state(
                    folder, args=self.args, iteration=self.iteration, kl_controller=self.kl_ctl,
                    reward_moments=self.reward_moments, guard=self._guard, peft=wrapper.is_peft_model,
                    metrics=self._metrics, critic_state=wrapper.critic_state_dict(), rewards=self.rewards,
                    rollout_buffer=schedule.state_dict() if schedule is not None else None)
        self._checkpoint_being_written = folder
        try:
            with written():
                super()._save_checkpoint(model, trial)
        finally:
            self._checkpoint_being_written = None

    # ---- publishing: the policy alone, with its model card ----------------------------------------------------------
    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Resolve the repo id at construction (a clear error now, not after training); the push creates it."""
        token = token if token is not None else self.args.hub_token
        self.hub_model_id = publish.resolve_repo_id(self.args.hub_model_id, self.args.output_dir, token)
        self.push_in_progress = None

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Checkpoints hold optimizer and value-head state, which never go to the Hub: only `push_to_hub` pushes."""

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None,
                    create_pr: bool = False, dataset_name: str | list[str] | None = None, **kwargs):
        """Save the policy to `output_dir`, render its model card and upload only the policy files.

        The LoRA adapter (or full weights) + tokenizer + card + training-curve plot; with `push_merged_model`, the
        adapter merged into a full-precision base instead (in `output_dir/merged`). Never the critic (it goes to
        `critic_hub_model_id`, its own repo, when set), reference, reward model, optimizer state or training_args.bin.
        A failed push raises `HubPushError`, leaves the local output intact, and is retried by `push_to_hub()`.
        Trainer's other card arguments (`model_name`, `tags`, `license`, ...) are refused before anything is saved,
        not dropped: the card has no place for them (as `create_model_card` refuses them).
        """
        if kwargs:
            raise TypeError(f"push_to_hub({', '.join(sorted(kwargs))}=...): hf_ppo's push takes commit_message, "
                            "blocking, token, revision, private, create_pr and dataset_name; its model card has no "
                            "place for the others, and nothing was saved or pushed. The card's title is the repo's "
                            "name (hub_model_id); edit README.md on the Hub after the push for more.")
        self.callback_handler.on_push_begin(self.args, self.state, self.control)  # as Trainer's push_to_hub
        args = self.args
        token = token if token is not None else args.hub_token
        repo_id = self.hub_model_id or publish.resolve_repo_id(args.hub_model_id, args.output_dir, token)
        self.save_model(args.output_dir, _internal_call=True)
        folder = os.path.join(args.output_dir, "merged") if args.push_merged_model else args.output_dir
        if args.push_merged_model and not self.accelerator.unwrap_model(self.model).is_peft_model:
            self.save_model(folder, _internal_call=True)
        elif args.push_merged_model and args.should_save:  # the adapter merged into a full-precision base
            publish.save_merged_policy(args.output_dir, self._model_sources["model"], folder, self.processing_class,
                                   args.model_init_kwargs)
        if not self.is_world_process_zero():
            return None
        names = [dataset_name] if isinstance(dataset_name, str) else list(dataset_name or [])
        self._write_card(folder, repo_id, merged=args.push_merged_model, dataset_names=names)
        publish.push_run_critic(self.accelerator.unwrap_model(self.model), self.processing_class,
                                args.critic_hub_model_id, repo_id, private=args.hub_private_repo, token=token)
        return publish.push_policy_folder(folder, repo_id, token=token,
                                      private=private if private is not None else args.hub_private_repo,
                                      revision=revision if revision is not None else args.hub_revision,
                                      create_pr=create_pr, commit_message=commit_message or "Upload PPO policy")

    def push_critic_to_hub(self, repo_id: str, *, private: bool | None = None, token: str | None = None,
                           commit_message: str = "Upload hf_ppo critic"):
        """Push the critic, as `model.save_critic` writes it, with a card, to the Hub repo `repo_id` (a repo of its
        own, never the policy's): a later run starts from it with `PPOLMTrainer(critic_model=repo_id)`
        (`hf_ppo.hub.push_critic`). `private` None: the run's `hub_private_repo`, as for the policy. Returns the
        commit info (None on processes other than the main one)."""
        if not self.is_world_process_zero():
            return None
        private = private if private is not None else self.args.hub_private_repo
        return publish.push_critic(self.accelerator.unwrap_model(self.model), repo_id, self.processing_class,
                                   private=private, token=token if token is not None else self.args.hub_token,
                                   commit_message=commit_message)

    def create_model_card(self, model_name: str | None = None, dataset_name: str | list[str] | None = None,
                          **unsupported) -> None:
        """TRL's call: write the model card of the policy `save_model()` saved in `output_dir` again, naming the
        datasets it was trained on (`dataset_name`: Hub ids are linked, a local file is named 'a local dataset';
        `save_model()` alone knows none). `model_name`: the card's title (default: the folder's name). Trainer's
        other card arguments (`license`, `tags`, ...) are refused, not dropped: the card has no place for them."""
        if unsupported:
            raise TypeError(f"create_model_card({', '.join(sorted(unsupported))}=...): hf_ppo's policy card takes "
                            "model_name and dataset_name only (TRL's call); edit README.md after it is written for more.")
        folder = self.args.output_dir
        names = [dataset_name] if isinstance(dataset_name, str) else list(dataset_name or [])
        if self.args.should_save:
            self._write_card(folder, model_name or os.path.basename(os.path.abspath(folder)), merged=False,
                             dataset_names=names, saved_locally=True)

    def _write_card(self, folder: str, repo_id: str, merged: bool, dataset_names: list[str],
                    saved_locally: bool = False) -> bool:
        """Render the policy's model card (and its plot) into `folder`; return whether the policy is an adapter."""
        policy = self.accelerator.unwrap_model(self.model).policy_model
        peft_config = policy.peft_config[self.trained_adapter].to_dict() if self.trained_adapter else None
        with checkpoint.save_failures_named(folder, self.args.output_dir, "the policy's model card",
                                            f"The policy itself is saved in {folder}"):
            return cards.write_policy_card(folder, peft_config, self._model_sources, self.args.publish_settings,
                                           self.state.log_history, repo_id=repo_id, merged=merged,
                                           dataset_names=dataset_names, saved_locally=saved_locally,
                                           chat_prompts=self._chat_prompts)
