"""Floor 7, the command line: `hf-ppo train / evaluate / demo` (`command`), the YAML recipe that is `hf-ppo train`
(`train`), the offline demo (`demo`) and the tiny models it and the tests build (`tiny`). Heavy imports wait inside
functions, so that `hf-ppo --help` starts fast."""

from .command import main

__all__ = ["main"]
