"""One self-contained HTML file from a page dict: styles, plotly.js, data and the page script inline.

Nothing is fetched at view time (plotly.js comes from the installed `plotly` package). The page
data travels as JSON inside `<script type="application/json">`, with `<`, `>`, `&` and the JS line
separators written as \\u escapes, so no model text can close the script element or open a tag; the
page script puts every string into the DOM with textContent.
"""

from __future__ import annotations

import html
import json
import math
import re
import time
from importlib import resources

import numpy as np

import lpf
from lpf.core.errors import LpfError

_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
_ESCAPE_RE = re.compile("[<>&\u2028\u2029]")


def jsonable(obj):
    """Plain JSON data: numpy scalars and arrays unwrapped, NaN and infinities as null."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        return jsonable(obj.item())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def script_json(obj) -> str:
    """JSON safe to place inside a <script> element."""
    text = json.dumps(jsonable(obj), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return _ESCAPE_RE.sub(lambda m: _ESCAPES[m.group(0)], text)


def plotly_js() -> tuple[str, str]:
    """(plotly.min.js source, its version) from the installed plotly package."""
    try:
        src = (resources.files("plotly") / "package_data" / "plotly.min.js").read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise LpfError(
            f"the report needs the plotly package's bundled plotly.min.js ({e}): pip install plotly"
        ) from None
    if "</script" in src.lower():  # would end the inline element early; never true of a real build
        raise LpfError("the installed plotly.min.js cannot be inlined (contains '</script')")
    m = re.search(r"plotly\.js v([\w.\-]+)", src[:400])
    return src, m.group(1) if m else "?"


# pages drawn by a script of their own (it registers `window.lpfPages[kind]`, which report.js calls
# with its DOM helpers), so a new directory kind does not grow report.js
PAGE_SCRIPTS = {"shrink": "shrink_page.js", "locate": "locate_page.js"}


def _asset(name: str) -> str:
    return (resources.files("lpf.report") / "assets" / name).read_text(encoding="utf-8")


def render(page: dict, title: str) -> str:
    plotly_src, plotly_version = plotly_js()
    page = dict(
        page,
        meta={
            "generated": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "lpf_version": lpf.__version__,
            "plotly_version": plotly_version,
        },
    )
    return "".join(
        [
            '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n',
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n',
            f"<title>{html.escape(title)}</title>\n",
            "<style>\n",
            _asset("report.css"),
            "\n</style>\n",
            "<script>\n",
            plotly_src,
            "\n</script>\n",
            "</head>\n<body>\n",
            '<noscript><p class="noscript">This report draws its sections with JavaScript; enable it to see them.</p></noscript>\n',
            '<div id="app"></div>\n<div id="tip" class="tip" role="tooltip" hidden></div>\n',
            '<script type="application/json" id="lpf-data">',
            script_json(page),
            "</script>\n",
            *(
                ["<script>\n", _asset(PAGE_SCRIPTS[page.get("kind")]), "\n</script>\n"]
                if page.get("kind") in PAGE_SCRIPTS
                else []
            ),
            "<script>\n",
            _asset("report.js"),
            "\n</script>\n",
            "</body>\n</html>\n",
        ]
    )
