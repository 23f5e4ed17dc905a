"""A learner's first hour: the student notebook of module 01 opens in Jupyter and runs, cell by cell, up to the
first exercise, where the only error is that exercise's `NotImplementedError`.

CI also runs this file as a script (`python tests/test_first_hour.py`) in a fresh environment made with the
README's learner install, which has Jupyter but neither pytest nor nbdev."""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIRST = ROOT / 'modules' / '01_tensor' / '01a_tensor.ipynb'


def first_error(path, timeout=300):
    "Run the notebook at `path` in a fresh kernel until a cell fails: `(cells run, failing cell source, error name, message)`."
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    nb = nbformat.read(str(path), as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name=nb.metadata.get('kernelspec', {}).get('name', 'python3'),
                            resources={'metadata': {'path': str(ROOT)}})
    ran = 0
    with client.setup_kernel():
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != 'code': continue
            try: client.execute_cell(cell, i)
            except CellExecutionError as e: return ran, cell.source, e.ename, e.evalue
            ran += 1
    return ran, None, None, None


def check_first_hour():
    nb = json.loads(FIRST.read_text())
    assert nb['metadata']['kernelspec']['name'] == 'python3', "student notebooks must name a kernel"
    ran, source, ename, evalue = first_error(FIRST)
    assert ename == 'NotImplementedError' and 'Exercise 01.1 unbroadcast' in evalue, (ran, source, ename, evalue)
    assert ran >= 3, f"only {ran} cells ran before the first exercise"
    return ran


def test_student_notebook_runs_up_to_the_first_exercise():
    check_first_hour()


def _first_parts():
    from tinycomp.course.spec import modules
    return [(k, sorted((ROOT / 'modules' / s.folder).glob('*.ipynb'))[0]) for k, s in modules().items() if k != '01']


try: import pytest                     # the learner's environment (CI runs this file there as a script) has no pytest
except ImportError: pytest = None

if pytest is not None:
    @pytest.mark.parametrize('key,path', _first_parts(), ids=lambda v: v if isinstance(v, str) else v.name)
    def test_every_module_runs_up_to_its_first_exercise(key, path):
        "Each module's first student notebook runs in Jupyter until its first exercise raises `NotImplementedError`."
        ran, source, ename, evalue = first_error(path)
        assert ename == 'NotImplementedError' and f'Exercise {key}.1 ' in evalue, (ran, source, ename, evalue)


if __name__ == '__main__':
    n = check_first_hour()
    print(f"first hour: {FIRST.relative_to(ROOT)} ran {n} code cells, then stopped at exercise 01.1 as it should")
    sys.exit(0)
