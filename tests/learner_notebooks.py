"""Student notebooks with a learner's extra code: what the grader tests hand in for an honest or a hostile learner."""
import json
from pathlib import Path

from tinycomp.course.notebooks import read_notebook
from tinycomp.course.spec import get_spec

ROOT = Path(__file__).resolve().parent.parent


def with_export_cell(tmp, key, source, part=None) -> list:
    """The paths of module `key`'s student notebooks, written under `tmp`, with an export cell `source` appended to the
    part named `part` (a notebook's stem; default: the last part)."""
    parts = sorted((ROOT / 'modules' / get_spec(key).folder).glob('*.ipynb'))
    target = parts[-1].stem if part is None else part
    if target not in {p.stem for p in parts}: raise ValueError(f"module {key} has no part {target!r}")
    tmp = Path(tmp); tmp.mkdir(parents=True, exist_ok=True)
    for p in parts:
        nb = read_notebook(p)
        if p.stem == target:
            nb['cells'].append({'cell_type': 'code', 'metadata': {}, 'outputs': [], 'execution_count': None,
                                'source': '#| export\n' + source})
        (tmp / p.name).write_text(json.dumps(nb))
    return [tmp / p.name for p in parts]
