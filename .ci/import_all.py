"""Import every bumblebee module in the current environment (CI runs this in a bare venv).

A module behind an optional extra may fail, but only with an ImportError (or ConfigError) whose
one-line message names the extra to install; any other failure is a missing core dependency.
"""

import importlib
import pkgutil
import sys

import bumblebee

# module -> the extra whose packages it imports at module level
EXTRAS = {"bumblebee.integrations.verl": "verl"}

bad = []
for info in pkgutil.walk_packages(bumblebee.__path__, "bumblebee."):
    name = info.name
    if name.endswith(".__main__"):  # runs a command when imported
        continue
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - every failure is reported, not raised
        extra = EXTRAS.get(name)
        msg = str(e)
        if (
            extra
            and isinstance(e, ImportError)
            and f"bumblebee[{extra}]" in msg
            and "\n" not in msg
        ):
            print(f"ok (needs [{extra}]): {name}: {msg}")
            continue
        bad.append(f"{name}: {type(e).__name__}: {msg}")
if bad:
    print("modules that do not import in this environment:", *bad, sep="\n  ")
    sys.exit(1)
print("every bumblebee module imports")
