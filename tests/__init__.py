"""hf_ppo's tests: tests/<package>/test_<module>.py tests hf_ppo/<package>/<module>.py; tests/integration/ runs the
whole trainer, tests/project/ checks what sits beside the package (tests/test_layers.py keeps the tree so). A
package, so that helpers are imported by one name (`from tests.wiring_models import ...`) and two folders may hold
files of the same name."""
