# The compiled extension bik._cuda (csrc/cuda, bound in csrc/cuda/bindings.cpp): no type
# information; its functions are Any to the type checker.
from typing import Any

def __getattr__(name: str) -> Any: ...
