"""`reward_funcs` of `hf-ppo train` and `hf-ppo evaluate`: reward functions named in a YAML config or on the command
line, imported and checked before any model loads.

An entry is one of
- a dotted import path, `my_pkg.rewards.exact_match` or `trl.rewards.accuracy_reward` (`my_pkg.rewards:exact_match`
  also reads);
- a Python file and a name in it, `rewards.py:exact_match` (a relative file is looked up as the recipe's other
  paths: in the working directory, then in the config file's folder);
- a factory with arguments, a one-key mapping `{<path>: {<kwarg>: <value>, ...}}` (`<path>` in either form above):
  `<path>(**kwargs)` is called once and what it returns is the reward function. On the command line it is written as
  a JSON object: `--reward_funcs '{"trl.rewards.get_soft_overlong_punishment": {"max_completion_len": 64,
  "soft_punish_cache": 16}}'`.

Imports resolve as in `python their_script.py` and `python -m`, whichever way hf-ppo was started (the console
script's `sys.path[0]` is its scripts folder, not the working directory): a file's own folder is importable while
the file runs (`from helpers import ...` at its top finds `helpers.py` beside it), and the working directory while a
dotted path imports (a package of the project one runs from). Neither stays on `sys.path` afterwards.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..rollout.reward_calls import PROMPT_COLUMNS, check_reward_function, data_columns
from ..rollout.scoring import REWARD_FILE_MODULE

__all__ = ["PROMPT_COLUMNS", "RewardFunc", "RewardFuncsError", "check_signatures", "load_reward_funcs",
           "parse_entries"]

FORMS = ("a dotted import path (my_pkg.rewards.exact_match), a file and a name (rewards.py:exact_match), or a factory "
         "{path: {argument: value}}")


class RewardFuncsError(ValueError):
    """A `reward_funcs` entry that cannot be used: names the entry and the fix."""


@dataclass
class RewardFunc:
    """One loaded entry: `entry` as the user wrote it (for messages), `func` the callable the trainer scores with."""

    entry: str
    func: Callable


def parse_entries(value: Any) -> list:
    """The entries of `reward_funcs` as YAML or the command line gave them: a list of str (a path, or on the command
    line a JSON object for a factory, decoded when loaded) and one-key mappings. A single entry may be given without
    its list."""
    if value is None:
        return []
    if isinstance(value, (str, dict)):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise RewardFuncsError(f"reward_funcs={value!r}: give a list of entries, each {FORMS}.")
    return list(value)


def _decode(item: Any) -> Any:
    """A command-line factory (a JSON object) as its mapping; any other entry as it is."""
    if not (isinstance(item, str) and item.lstrip().startswith("{")):
        return item
    try:
        return json.loads(item)
    except json.JSONDecodeError as err:
        raise RewardFuncsError(
            f"reward_funcs entry {item!r} is not valid JSON ({err}): a factory on the command line is a JSON object, "
            """e.g. '{"trl.rewards.get_soft_overlong_punishment": {"max_completion_len": 64, "soft_punish_cache": """
            """16}}' (double quotes, the whole object in single quotes).""") from err


def describe(entry: Any) -> str:
    """How messages name an entry: as written (a factory as compact JSON-like text)."""
    if isinstance(entry, dict):
        return json.dumps(entry, default=str)
    return str(entry)


def load_reward_funcs(value: Any, config_dir: str | None = None) -> list[RewardFunc]:
    """Import every entry of `reward_funcs` (see the module's docstring); raise `RewardFuncsError` listing every
    entry that cannot be used (one line each: the entry, the cause, the fix)."""
    loaded, errors = [], []
    for entry in parse_entries(value):
        try:
            entry = _decode(entry)
            func = _load_entry(entry, config_dir)
            check_reward_function(func, None, describe(entry))  # the columns are checked once the data is read
            loaded.append(RewardFunc(describe(entry), func))
        except RewardFuncsError as err:
            errors.append(str(err))
        except TypeError as err:
            errors.append(f"reward_funcs: {err}")
    if errors:
        raise RewardFuncsError("\n".join(errors))
    return loaded


def check_signatures(funcs: list[RewardFunc], datasets: dict) -> None:
    """Check that each function can take the call it will get on each dataset (`{name: dataset or None}`), with
    `check_reward_function`; raise `RewardFuncsError` naming the entry, the dataset and the fix."""
    errors = []
    for reward in funcs:
        for source, dataset in datasets.items():
            if dataset is None:
                continue
            try:
                check_reward_function(reward.func, data_columns(dataset.column_names), reward.entry)
            except TypeError as err:
                errors.append(f"reward_funcs (on {source}): {err}")
                break  # once per entry: the same fix serves every dataset
    if errors:
        raise RewardFuncsError("\n".join(errors))


@contextmanager
def _importable(folder: str) -> Iterator[None]:
    """`folder` first on `sys.path` inside the block (unless it is already there, or '' stands for it), as Python puts
    a script's folder there; removed after, so nothing outlives the import."""
    present = os.path.abspath(folder) in {os.path.abspath(p or os.curdir) for p in sys.path}
    if not present:
        sys.path.insert(0, folder)
    try:
        yield
    finally:
        if not present and folder in sys.path:
            sys.path.remove(folder)


def _load_entry(entry: Any, config_dir: str | None) -> Callable:
    if isinstance(entry, dict):
        return _call_factory(entry, config_dir)
    if not isinstance(entry, str) or not entry.strip():
        raise RewardFuncsError(f"reward_funcs entry {entry!r} is a {type(entry).__name__}: each entry is {FORMS}.")
    func = _resolve(entry.strip(), config_dir)
    if inspect.ismodule(func):
        raise RewardFuncsError(f"reward_funcs entry {entry!r} is a module, not a function: name a function in it, "
                               f"{_functions_of(func, entry.strip())}.")
    if inspect.isclass(func):
        raise RewardFuncsError(
            f"reward_funcs entry {entry!r} is a class, not a reward function: write it as a factory, "
            f"{{{entry!r}: {{<its arguments>}}}} in YAML, so that its instance (which must be callable) is the reward "
            "function, or name a function.")
    if not callable(func):
        raise RewardFuncsError(
            f"reward_funcs entry {entry!r} is not callable (it is {type(func).__name__} {func!r:.60}): name a "
            "function (completions, **kwargs) -> list[float] (TRL's convention), or (prompts, completions) -> list[float].")
    return func


def _call_factory(entry: dict, config_dir: str | None) -> Callable:
    shown = describe(entry)
    example = "{'trl.rewards.get_soft_overlong_punishment': {'max_completion_len': 64, 'soft_punish_cache': 16}}"
    if len(entry) != 1:
        raise RewardFuncsError(f"reward_funcs entry {shown}: a factory is a mapping with one key (the factory's path) "
                               f"whose value holds its arguments, e.g. {example}; write one list item per factory.")
    (path, kwargs), = entry.items()
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(path, str) or not isinstance(kwargs, dict):
        raise RewardFuncsError(f"reward_funcs entry {shown}: a factory is {{<path>: {{<argument>: <value>}}}}, e.g. "
                               f"{example}; got {type(kwargs).__name__} arguments.")
    factory = _resolve(path.strip(), config_dir)
    if not callable(factory):
        raise RewardFuncsError(f"reward_funcs entry {shown}: {path!r} is a {type(factory).__name__}, not a factory "
                               "(a callable returning a reward function).")
    try:
        func = factory(**kwargs)
    except Exception as err:  # any failure of user code is reported with the entry that caused it
        try:
            signature = f"{path}{inspect.signature(factory)}"
        except (TypeError, ValueError):
            signature = path
        raise RewardFuncsError(f"reward_funcs entry {shown}: calling {path}(**{kwargs!r}) failed: "
                               f"{type(err).__name__}: {err}. Fix the arguments (its signature: {signature}).") from err
    if not callable(func):
        raise RewardFuncsError(f"reward_funcs entry {shown}: {path}(**{kwargs!r}) returned a {type(func).__name__}, "
                               "not a reward function; a factory must return a callable. To use the function itself, "
                               f"write the entry as the plain string {path!r}.")
    return func


def _resolve(path: str, config_dir: str | None) -> Any:
    """The object a path names: `file.py:name`, `package.module:name` or `package.module.name`; a dotted path is
    imported with the working directory importable (`_importable`), as `python -m` has it."""
    with _importable(os.getcwd()):
        return _resolve_path(path, config_dir)


def _resolve_path(path: str, config_dir: str | None) -> Any:
    module_part, sep, name = path.rpartition(":")
    if sep and (module_part.endswith(".py") or "/" in module_part or os.sep in module_part):
        return _attribute(_load_file(module_part, path, config_dir), name, path, module_part)
    if sep:
        if not module_part or not name:
            raise RewardFuncsError(f"reward_funcs entry {path!r}: {FORMS}.")
        return _attribute(_import(module_part, path), name, path, module_part)
    if path.endswith(".py"):
        raise RewardFuncsError(f"reward_funcs entry {path!r} names a file but not the function in it: write "
                               f"'{path}:<function name>'.")
    parts = path.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise RewardFuncsError(f"reward_funcs entry {path!r} is not a path to a function: give {FORMS}.")
    # The longest prefix that is a module; the rest are attributes (a function, or a class's static method). The
    # whole path is tried too: a module named where a function was meant is told so (`_load_entry`).
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if cut > 1 and err.name is not None and (module_name + ".").startswith(err.name + "."):
                continue  # not a module: maybe an attribute of a shorter prefix
            raise _import_error(path, module_name, err) from err
        except (Exception, SystemExit) as err:  # the module's own code failed (or exited) while importing
            raise _import_error(path, module_name, err) from err
        obj = module
        for i, attr in enumerate(parts[cut:]):
            obj = _attribute(obj, attr, path, ".".join(parts[:cut + i]))
        return obj
    raise RewardFuncsError(f"reward_funcs entry {path!r}: cannot import it.")  # unreachable: cut=1 raises above


def _import(module_name: str, path: str):
    try:
        return importlib.import_module(module_name)
    except (Exception, SystemExit) as err:  # any import failure (an exit too) is reported with the entry
        raise _import_error(path, module_name, err) from err


def _import_error(path: str, module_name: str, err: BaseException) -> RewardFuncsError:
    missing = isinstance(err, ModuleNotFoundError)
    fix = ("install the package that provides it, or put its folder on PYTHONPATH; for a file of your own, write "
           "'path/to/rewards.py:<function name>'" if missing else f"fix the error in {module_name!r}")
    if isinstance(err, SystemExit):
        return RewardFuncsError(f"reward_funcs entry {path!r}: importing {module_name!r} called exit({err.code!r}) "
                                f"(SystemExit). {_EXIT_FIX}.")
    return RewardFuncsError(f"reward_funcs entry {path!r}: cannot import {module_name!r}: {type(err).__name__}: "
                            f"{err}. To use it, {fix}.")


def _load_file(file: str, path: str, config_dir: str | None):
    """The module of a Python file, found as the recipe's other relative paths are (working directory, then the
    config's folder); loaded once per file."""
    expanded = os.path.expanduser(file)
    candidates = [os.path.abspath(expanded)]
    if config_dir is not None and not os.path.isabs(expanded):
        candidates.append(os.path.normpath(os.path.join(config_dir, expanded)))
    found = next((c for c in candidates if os.path.isfile(c)), None)
    if found is None:
        where = " nor ".join(dict.fromkeys(candidates))
        where = f"neither {where}" if " nor " in where else f"not {where}"
        raise RewardFuncsError(f"reward_funcs entry {path!r}: the file {file!r} was not found: it is {where}. "
                               "Fix the path (relative paths are read from the working directory, then from the "
                               "config file's folder).")
    digest = hashlib.sha1(found.encode()).hexdigest()[:10]
    module_name = f"{REWARD_FILE_MODULE}{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, found)
    if spec is None or spec.loader is None:
        raise RewardFuncsError(f"reward_funcs entry {path!r}: {found} is not a Python file Python can load: give a "
                               ".py file.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickle look a module up by name while it runs
    try:
        with _importable(os.path.dirname(found)):  # its own folder, as `python rewards.py` has it
            spec.loader.exec_module(module)
    except BaseException as err:
        del sys.modules[module_name]
        if isinstance(err, SystemExit):  # sys.exit() at import: the whole run would end, silently with exit(0)
            raise RewardFuncsError(f"reward_funcs entry {path!r}: running {found} called exit({err.code!r}) "
                                   f"(SystemExit) while it was imported. {_EXIT_FIX}.") from err
        if not isinstance(err, Exception):
            raise
        raise RewardFuncsError(f"reward_funcs entry {path!r}: running {found} failed: {type(err).__name__}: {err}. "
                               "Fix the error in that file.") from err
    return module


# What a module that exits while it is imported is told (its script part would end the whole run).
_EXIT_FIX = ("A reward file is imported, not run: put the code that runs it as a script under "
             "`if __name__ == \"__main__\":`")


def _functions_of(module, path: str) -> str:
    """'e.g. path.f, path.g (its functions)' for a module named where a reward function was meant."""
    functions = [n for n in getattr(module, "__all__", None) or dir(module) if not n.startswith("_")
                 and inspect.isfunction(getattr(module, n, None))]
    if not functions:
        return "it defines no function"
    listed = ", ".join(f"{path}.{n}" for n in functions[:8]) + (" ..." if len(functions) > 8 else "")
    return f"e.g. {listed}"


def _attribute(owner, name: str, path: str, owner_name: str) -> Any:
    """`owner.name`, or an error listing a few of the callables `owner` has (the nearest first)."""
    if hasattr(owner, name):
        return getattr(owner, name)
    public = [n for n in dir(owner) if not n.startswith("_")]
    callables = [n for n in public if callable(getattr(owner, n, None)) and not inspect.ismodule(getattr(owner, n))]
    own = [n for n in callables if getattr(getattr(owner, n), "__module__", None) == getattr(owner, "__name__", None)]
    ordered = list(dict.fromkeys(difflib.get_close_matches(name, callables, n=3, cutoff=0.5) + own + callables))
    listed = ", ".join(ordered[:8]) + (f" (and {len(ordered) - 8} more)" if len(ordered) > 8 else "")
    hint = f"It has these callables: {listed}." if ordered else "It defines no callable."
    raise RewardFuncsError(f"reward_funcs entry {path!r}: {owner_name!r} has no {name!r}. {hint} Fix the "
                           "name in the entry.")
