"""The package and the student notebooks are what the instructor's notebooks say: a forgotten `nbdev_export` or
`tinycomp release` fails here, in the fast lane, before CI's own check of the committed files."""
import filecmp, shutil, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _python_files(root: Path) -> dict:
    return {str(p.relative_to(root)): p for p in root.rglob('*.py') if '__pycache__' not in p.parts}


def test_the_package_is_exported_from_the_notebooks(tmp_path):
    shutil.copytree(ROOT / 'nbs', tmp_path / 'nbs')
    shutil.copy(ROOT / 'settings.ini', tmp_path)
    (tmp_path / 'tinycomp').mkdir()
    r = subprocess.run([sys.executable, '-c', 'from nbdev.doclinks import nbdev_export; nbdev_export()'], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    exported, package = _python_files(tmp_path / 'tinycomp'), _python_files(ROOT / 'tinycomp')
    assert sorted(exported) == sorted(package), "run nbdev_export: files differ " \
        f"(only in the package: {sorted(set(package) - set(exported))}; only exported: {sorted(set(exported) - set(package))})"
    stale = [f for f in sorted(exported) if not filecmp.cmp(exported[f], package[f], shallow=False)]
    assert not stale, f"tinycomp/ is out of date with nbs/: run nbdev_export ({', '.join(stale)})"


def test_the_student_notebooks_are_generated_from_the_notebooks(capsys):
    from tinycomp.course.release import release
    assert release(check=True) == 0, capsys.readouterr().out + "\nrun `tinycomp release`"
