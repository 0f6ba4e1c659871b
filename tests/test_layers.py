"""The package's import direction: sub-packages on floors, every import pointing down or within its own package,
and no loop between modules. Imports inside functions count too: one that dodges a loop is the loop still there.
And the test tree's shape: tests/<package>/test_<module>.py mirrors hf_ppo/<package>/<module>.py."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hf_ppo"

# Lowest first. A module imports from its own package or from a package on a lower floor; packages on one floor
# do not import each other.
FLOORS = {"runtime": 1, "algorithms": 1, "rewards": 1, "models": 2, "rollout": 3, "evaluation": 4, "hub": 5,
          "trainer": 6, "compat": 7, "cli": 7}
TOP = 8  # hf_ppo/__init__.py and the thin aliases beside it
# cli/ may import inside functions, to keep `hf-ppo --help` fast.
LAZY_ALLOWED = {"cli"}
MAX_TOP_LEVEL_MODULES = 6
MAX_LINES = 800


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FLOORS else None


def floor_of(module: str) -> int:
    package = package_of(module)
    return FLOORS[package] if package else TOP


def resolve(module: str, is_package: bool, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The hf_ppo modules an import statement names (a `from X import y` names X.y when that is a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "hf_ppo"]
    if node.level:
        base = module.split(".")
        base = base if is_package else base[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != "hf_ppo":
        return []
    found = []
    for alias in node.names:
        candidate = f"{target}.{alias.name}"
        if (PACKAGE.parent / (candidate.replace(".", "/") + ".py")).is_file() or \
                (PACKAGE.parent / candidate.replace(".", "/") / "__init__.py").is_file():
            found.append(candidate)
        else:
            found.append(target)
    return found


def imports() -> list[tuple[str, int, str, bool]]:
    """(module, line, imported module, inside a function) for every hf_ppo import in the package."""
    rows = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        in_function = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                in_function.update(id(n) for n in ast.walk(node) if n is not node)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in resolve(module, path.name == "__init__.py", node):
                    rows.append((module, node.lineno, target, id(node) in in_function))
    return rows


def location(module: str, line: int) -> str:
    path = module.replace(".", "/")
    path = path + "/__init__.py" if (PACKAGE.parent / path).is_dir() else path + ".py"
    return f"{path}:{line}"


def test_every_import_points_down_or_within_its_package():
    wrong = []
    for module, line, target, _ in imports():
        if target == "hf_ppo" and module != "hf_ppo":
            wrong.append(f"{location(module, line)} imports the top-level hf_ppo (import from the sub-package)")
            continue
        same = package_of(module) is not None and package_of(module) == package_of(target)
        if not same and floor_of(target) >= floor_of(module) and module.count(".") > 0 and floor_of(module) < TOP:
            wrong.append(f"{location(module, line)}: {module} (floor {floor_of(module)}) imports {target} "
                         f"(floor {floor_of(target)})")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def test_no_import_inside_a_function_outside_cli():
    wrong = [f"{location(m, line)} imports {t} inside a function" for m, line, t, lazy in imports()
             if lazy and package_of(m) not in LAZY_ALLOWED]
    assert not wrong, "\n".join(wrong)


def test_no_import_loop():
    graph: dict[str, set[str]] = {}
    for module, _, target, _ in imports():
        if target != module:
            graph.setdefault(module, set()).add(target)
    # A package's __init__ hands on its modules' names: an edge module -> its own package's __init__ is a loop
    # only if that __init__ is reached back, which the search below finds like any other.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            pytest.fail("import loop: " + " -> ".join(cycle))


def test_no_module_keeps_a_name_nothing_in_the_package_reads():
    """A module imports an hf_ppo name to use it, to list it in its `__all__`, or for another module of the package to
    import from it. A name kept at an old home that only a test reads is not kept: the test imports it from its real
    home. (`__init__.py` files and the aliases beside hf_ppo/__init__.py hand names on by design.)"""
    bound: dict[tuple[str, str], str] = {}  # (module, name) -> where it is imported
    readers: set[tuple[str, str]] = set()  # (module, name) read from that module by another one
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        own = path.name != "__init__.py" and path.parent != PACKAGE
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        listed = {e.value for node in tree.body if isinstance(node, ast.Assign)
                  for t in node.targets if isinstance(t, ast.Name) and t.id == "__all__"
                  for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)}
        modules_bound = {}  # local name -> the hf_ppo module it is
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            targets = resolve(module, path.name == "__init__.py", node)
            for alias, target in zip(node.names, targets):
                local = alias.asname or alias.name
                if target.endswith(f".{alias.name}"):  # the name is a module
                    modules_bound[local] = target
                else:
                    readers.add((target, alias.name))
                    if own and local not in used and local not in listed:
                        bound[(module, local)] = location(module, node.lineno)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules_bound:
                readers.add((modules_bound[node.value.id], node.attr))
    unread = sorted(f"{where} imports {name}, which {module} does not use and no module reads from it"
                    for (module, name), where in bound.items() if (module, name) not in readers)
    assert not unread, "\n".join(unread)

def test_the_package_keeps_its_shape():
    top = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"modules directly in hf_ppo/: {top}"
    assert set(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()) == set(FLOORS)
    long = [f"{p.relative_to(PACKAGE.parent)}: {len(p.read_text().splitlines())} lines"
            for p in PACKAGE.rglob("*.py") if len(p.read_text().splitlines()) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_each_package_hands_on_its_names():
    for package in FLOORS:
        init = PACKAGE / package / "__init__.py"
        tree = ast.parse(init.read_text())
        names = [t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
                 if isinstance(t, ast.Name)]
        assert "__all__" in names, f"{init} has no __all__"


def test_the_import_paths_users_have_keep_working():
    """The top-level names and `hf_ppo.trl011` (a path the README showed before the move) are the objects of their
    new homes."""
    import hf_ppo
    from hf_ppo.compat import trl011
    from hf_ppo.models import AutoModelForCausalLMWithValueHead
    from hf_ppo.rollout import EnvSample, Environment, RolloutEngine
    from hf_ppo.trainer import PPOConfig, PPOLMTrainer
    from hf_ppo.trl011 import AutoModelForCausalLMWithValueHead as TRLValueHead, PPOConfig as TRLConfig, PPOTrainer

    assert (hf_ppo.PPOConfig, hf_ppo.PPOLMTrainer, hf_ppo.AutoModelForCausalLMWithValueHead, hf_ppo.EnvSample,
            hf_ppo.Environment, hf_ppo.RolloutEngine) == (PPOConfig, PPOLMTrainer, AutoModelForCausalLMWithValueHead,
                                                          EnvSample, Environment, RolloutEngine)
    assert TRLValueHead is AutoModelForCausalLMWithValueHead
    assert (TRLConfig, PPOTrainer) == (trl011.PPOConfig, trl011.PPOTrainer)
    for package in FLOORS:  # every name a package hands on exists
        module = __import__(f"hf_ppo.{package}", fromlist=["__all__"])
        assert all(hasattr(module, name) for name in module.__all__), package


# ---- the tests mirror the package ------------------------------------------------------------------------------------
TESTS = Path(__file__).resolve().parent
# Tests of the whole system, which belong to no one module, each in a folder named here with what goes in it.
WHOLE_SYSTEM = {
    "integration": "the whole trainer run end to end and checked against something outside it (a plain reference, "
                   "real checkpoints, several processes, a GPU, every architecture, features combined)",
    "project": "what sits beside the package (the documentation site, the benchmarks)",
}
AT_ROOT = {"test_layers.py"}  # this file, which keeps both trees in shape


def module_exists(path: str) -> bool:
    """Whether hf_ppo/<path> exists."""
    return (PACKAGE / path).is_file()


def packages() -> list[str]:
    return sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())


def where_it_goes(path: Path) -> str:
    """Where a test file that sits outside the mirror belongs."""
    name = path.stem[len("test_"):]
    homes = [f"tests/{package}/test_{name}.py" for package in packages() if module_exists(f"{package}/{name}.py")]
    homes += [f"tests/{package}/test_{name}.py" for package in packages() if package == name]
    if homes:
        return f"move it to {' or '.join(homes)}"
    return ("name it after the module it tests, tests/<package>/test_<module>.py for hf_ppo/<package>/<module>.py "
            "(or tests/<package>/test_<package>.py for what a package promises as a whole); a test of the whole "
            "system goes to " + "; or ".join(f"tests/{folder}/: {what}" for folder, what in WHOLE_SYSTEM.items()))


def mirror_problem(path: Path) -> str | None:
    """None when tests/<path> sits where the layout says, else what is wrong and where it goes."""
    parts = path.parts
    if len(parts) == 1:
        return None if path.name in AT_ROOT else f"tests/{path} sits at the root of tests/: {where_it_goes(path)}"
    if len(parts) > 2:
        return f"tests/{path} sits too deep: {where_it_goes(path)}"
    folder, name = parts
    if folder in WHOLE_SYSTEM:
        module = [p for p in packages() if module_exists(f"{p}/{path.stem[len('test_'):]}.py")]
        return f"tests/{path} is named after a module, so it tests that module: {where_it_goes(path)}" if module \
            else None
    if folder not in packages():
        return f"tests/{folder}/ is no package of hf_ppo (nor {', '.join(WHOLE_SYSTEM)}): {where_it_goes(path)}"
    module = name[len("test_"):]
    if module == f"{folder}.py" or module_exists(f"{folder}/{module}"):
        return None
    return f"tests/{path}: there is no hf_ppo/{folder}/{module}; {where_it_goes(path)}"


def test_every_test_file_mirrors_a_module_or_tests_the_whole_system():
    wrong = [problem for path in sorted(p.relative_to(TESTS) for p in TESTS.rglob("test_*.py"))
             if (problem := mirror_problem(path))]
    assert not wrong, "test files outside the mirror:\n" + "\n".join(wrong)


def test_every_test_folder_is_a_package():
    """With __init__.py files, each test module has one import name (`tests.rollout.test_steps`): two folders may hold
    files of the same name, and a helper is imported as `from tests.wiring_models import ...` from any folder."""
    folders = {p.parent for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts}
    missing = sorted(str(f.relative_to(TESTS.parent)) for f in folders if not (f / "__init__.py").is_file())
    assert not missing, f"test folders without an __init__.py: {missing}"


def test_the_mirror_check_says_where_a_file_goes():
    assert mirror_problem(Path("test_layers.py")) is None
    assert mirror_problem(Path("trainer/test_watch.py")) is None
    assert mirror_problem(Path("integration/test_wiring.py")) is None
    assert "move it to tests/trainer/test_watch.py" in mirror_problem(Path("test_watch.py"))
    assert "no hf_ppo/trainer/watch_faults.py; name it after the module it tests" in \
        mirror_problem(Path("trainer/test_watch_faults.py"))
    assert "move it to tests/trainer/test_checkpoint.py" in mirror_problem(Path("integration/test_checkpoint.py"))
    assert "no package of hf_ppo" in mirror_problem(Path("watch/test_watch.py"))
    assert "too deep" in mirror_problem(Path("trainer/watch/test_watch.py"))



def test_no_module_below_the_trainer_reads_a_ppoconfig_field():
    """Settings reach the floors below `trainer/` as the records `PPOConfig` builds (docs/project/architecture.md,
    "How settings travel"), never as the config itself: no `args.<field>`, `config.<field>` or `<x>.args.<field>` for
    a PPOConfig field (TrainingArguments' included) in a module on floors 1-5."""
    import dataclasses

    from hf_ppo import PPOConfig

    fields = {f.name for f in dataclasses.fields(PPOConfig)}
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        if floor_of(module) >= FLOORS["trainer"]:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Attribute) and node.attr in fields):
                continue
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id in ("args", "config", "training_args")) or (
                    isinstance(owner, ast.Attribute) and owner.attr == "args"):
                wrong.append(f"{location(module, node.lineno)} reads {ast.unparse(node)}")
    assert not wrong, "PPOConfig fields read below the trainer (pass a record instead):\n" + "\n".join(wrong)
