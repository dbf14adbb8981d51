# The compiled extension bik._cpu (csrc/cpu, bound in csrc/cpu/bindings.cpp): no type
# information; its functions are Any to the type checker.
from typing import Any

def __getattr__(name: str) -> Any: ...
