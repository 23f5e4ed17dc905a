"The tinycomp console script."
import json
import subprocess
import sys

import pytest

import tinycomp
from tinycomp.cli import main


def run(*args, **kw):
    return subprocess.run([sys.executable, '-m', 'tinycomp.cli', *args], capture_output=True, text=True, timeout=600, **kw)


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(['--version'])
    assert e.value.code == 0
    assert tinycomp.__version__ in capsys.readouterr().out
    assert main([]) == 0
    out = capsys.readouterr().out
    for command in ('tour', 'train', 'bench', 'test', 'status', 'release', 'refs', 'grade'):
        assert command in out


def test_console_script_is_installed():
    result = subprocess.run(['tinycomp', '--version'], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and tinycomp.__version__ in result.stdout


def test_tour_prints_and_saves_its_figures(tmp_path):
    result = run('tour', '--out', str(tmp_path), '--no-progress')
    assert result.returncode == 0, result.stderr
    for label in ('test accuracy', 'parameters', 'bytes on disk', 'latency, batch of 64', 'latency per sample'):
        assert label in result.stdout
    assert (tmp_path / 'training_curve.png').stat().st_size > 1000
    assert (tmp_path / 'digits_cnn.npz').exists()


def test_train_writes_a_loadable_model(tmp_path):
    result = run('train', 'digits_cnn', '--epochs', '1', '--out', str(tmp_path), '--no-progress')
    assert result.returncode == 0, result.stderr
    from tinycomp.io import load
    model = load(tmp_path / 'digits_cnn.npz')
    info = json.loads((tmp_path / 'digits_cnn.json').read_text())
    assert info['parameters'] == 9_930 and len(info['history']['epoch']) == 1


def test_errors_become_a_message_and_exit_code(tmp_path):
    result = run('train', 'no_such_model')
    assert result.returncode != 0 and 'invalid choice' in result.stderr
