"Reference models, training loop, the shipped pretrained weights, the training curve and `tinycomp train`."

import json

import numpy as np
import pytest

from tinycomp.data import DataLoader, load_digits, split_sizes
from tinycomp.errors import TinycompError
from tinycomp.nn import parameter_counts
from tinycomp.models import (MODELS, TRAINING_CONFIGS, add_cli, digits_cnn, digits_cnn_wide,
                             evaluate, fit, load_pretrained, plot_history, pretrained_info,
                             pretrained_path, train_command, train_reference)
from tinycomp.optim import Adam
from tinycomp.tensor import manual_seed


def test_parameter_counts():
    assert parameter_counts(digits_cnn()).parameters == 9_930
    assert 90_000 < parameter_counts(digits_cnn_wide()).parameters < 120_000


@pytest.mark.parametrize('name,target', [('digits_cnn', 0.97), ('digits_cnn_wide', 0.98)])
def test_pretrained_models_reach_their_targets(name, target):
    model = load_pretrained(name)
    assert not model.training
    result = evaluate(model, load_digits('test'))
    assert result.accuracy >= target
    info = pretrained_info(name)
    assert info['test_accuracy'] == pytest.approx(result.accuracy)
    assert len(info['history']['epoch']) == info['training_config']['epochs']
    assert 'recipe' not in info           # records written before the key was renamed are read under the new name


def test_short_training_run_learns():
    manual_seed(0)
    model = digits_cnn()
    before = evaluate(model, load_digits('val'))
    history = fit(model, DataLoader(*load_digits('train'), batch_size=64, shuffle=True, seed=0),
                  DataLoader(*load_digits('val'), batch_size=256), epochs=2,
                  optimizer=Adam(model.parameters(), lr=1e-2), progress=False)
    assert set(history) >= {'train_loss', 'train_acc', 'val_loss', 'val_acc', 'lr', 'seconds'}
    assert len(history['val_acc']) == 2
    assert history['train_loss'][1] < history['train_loss'][0]
    assert history['val_acc'][-1] > 0.85 > before.accuracy + 0.3
    assert model.training  # fit leaves the model in training mode; evaluate restored it


def test_training_is_reproducible_with_a_seed():
    a, _ = train_reference('digits_cnn', epochs=1, progress=False)
    b, _ = train_reference('digits_cnn', epochs=1, progress=False)
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        np.testing.assert_array_equal(va, vb, err_msg=k)


def test_evaluate_accepts_arrays_and_rejects_empty():
    model = load_pretrained('digits_cnn')
    X, y = load_digits('test')
    assert evaluate(model, (X[:50], y[:50])).accuracy > 0.9
    with pytest.raises(TinycompError, match='empty'):
        evaluate(model, (X[:0], y[:0]))


def test_unknown_model_names_are_explained():
    with pytest.raises(TinycompError, match='unknown model'):
        pretrained_path('resnet50')
    with pytest.raises(TinycompError, match='unknown model'):
        train_reference('resnet50')


# --- validation curve: evaluated like the test split, on a small and harder split ---------------------------

def test_validation_history_is_an_eval_mode_evaluation():
    "A model with Dropout and BatchNorm: the recorded validation accuracy is `evaluate` (eval mode) of the final model."
    manual_seed(0)
    model = digits_cnn_wide()
    val = load_digits('val')
    history = fit(model, DataLoader(*load_digits('train'), batch_size=64, shuffle=True, seed=0),
                  DataLoader(*val, batch_size=256), epochs=1, optimizer=Adam(model.parameters(), lr=3e-3), progress=False)
    assert model.training
    again = evaluate(model, val)
    assert history['val_acc'][-1] == again.accuracy and history['val_loss'][-1] == pytest.approx(again.loss, rel=1e-6)


def test_shipped_validation_curve_ends_at_173_of_179():
    "The 0.9665 at the end of the shipped curve is 6 of 179 validation images; the same model gets 356/359 on test."
    assert split_sizes('digits') == {'train': 1259, 'val': 179, 'test': 359}
    model, info = load_pretrained('digits_cnn'), pretrained_info('digits_cnn')
    val, test = evaluate(model, load_digits('val')), evaluate(model, load_digits('test'))
    assert info['history']['val_acc'][-1] == pytest.approx(val.accuracy) == pytest.approx(173 / 179)
    assert test.accuracy == pytest.approx(356 / 359)


def test_plot_says_split_sizes_and_test_accuracy(tmp_path):
    history = pretrained_info('digits_cnn')['history']
    fig = plot_history(history, 'digits_cnn', tmp_path / 'curve.png', splits=split_sizes('digits'), test_accuracy=356 / 359)
    texts = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    texts += [t.get_text() for ax in fig.axes for t in ax.texts]
    joined = ' | '.join(texts)
    assert 'validation (179 images, 1 image = 0.56 %)' in joined and 'train (1259 images' in joined
    assert 'test, final model: 99.16%, 356/359' in joined and '173/179' in joined
    assert (tmp_path / 'curve.png').stat().st_size > 1000
    plot_history({**history, 'val_acc': [float('nan')] * len(history['epoch'])}, splits=split_sizes('digits'))  # no val loader


# --- tinycomp train ---------------------------------------------------------------------------------------

def test_train_command_choices_come_from_the_registry():
    import argparse
    parser = argparse.ArgumentParser(prog='tinycomp')
    add_cli(parser.add_subparsers(dest='command'))
    args = parser.parse_args(['train', 'digits_cnn_wide', '--epochs', '2', '--seed', '3', '--out', 'x', '--no-progress'])
    assert (args.name, args.epochs, args.seed, args.out, args.no_progress) == ('digits_cnn_wide', 2, 3, 'x', True)
    assert set(MODELS) == set(TRAINING_CONFIGS)
    with pytest.raises(SystemExit):
        parser.parse_args(['train', 'resnet50'])


def test_train_command_saves_and_refuses_a_file_as_out(tmp_path, capsys):
    path = train_command('digits_cnn', tmp_path, epochs=1, progress=False)
    assert path == tmp_path / 'digits_cnn.npz' and path.with_suffix('.json').exists()
    assert json.loads(path.with_suffix('.json').read_text())['training_config'] == {**TRAINING_CONFIGS['digits_cnn'], 'epochs': 1}
    out = capsys.readouterr().out                             # the record says what was run, not the default config
    assert 'test accuracy' in out and 'not compared with the shipped weights' in out
    with pytest.raises(TinycompError, match='not a directory'):
        train_command('digits_cnn', path, epochs=1, progress=False)
