"""Install wheels without pip (gpu_check.sh's fallback): each pinned requirement's wheel that fits this
Python (py3-none-any, or this CPython's cpXY tag on x86_64 Linux) unzipped into a target directory.
Usage: python scripts/gpu_unzip_wheels.py WHEELS_DIR TARGET REQUIREMENTS_TXT"""

import re
import sys
import zipfile
from pathlib import Path

wheels, target, reqs = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
target.mkdir(parents=True, exist_ok=True)
for line in reqs.read_text().splitlines():
    line = line.split("#")[0].strip()
    if not line:
        continue
    name, version = line.split("==")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    found = [
        w
        for w in wheels.glob("*.whl")
        if w.name.lower().startswith(f"{stem}-{version}-")
        and ("-py3-none-any" in w.name or (f"-{tag}-{tag}-" in w.name and "x86_64" in w.name))
    ]
    if not found:
        sys.exit(f"gpu_unzip_wheels: no wheel of {name}=={version} for {tag} in {wheels}")
    zipfile.ZipFile(found[0]).extractall(target)
    print(f"unzipped {found[0].name}", file=sys.stderr)
