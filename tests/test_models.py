"Reference models, training loop and the shipped pretrained weights."
import json

import numpy as np
import pytest

from tinycomp.data import DataLoader, load_digits
from tinycomp.errors import TinycompError
from tinycomp.models import (MODELS, count_parameters, digits_cnn, digits_cnn_wide, evaluate, fit, load_pretrained,
                             pretrained_info, pretrained_path, train_reference)
from tinycomp.tensor import Adam, manual_seed


def test_parameter_counts():
    assert count_parameters(digits_cnn()) == 9_930
    assert 90_000 < count_parameters(digits_cnn_wide()) < 120_000


@pytest.mark.parametrize('name,target', [('digits_cnn', 0.97), ('digits_cnn_wide', 0.98)])
def test_pretrained_models_reach_their_targets(name, target):
    model = load_pretrained(name)
    assert not model.training
    result = evaluate(model, load_digits('test'))
    assert result.accuracy >= target
    info = pretrained_info(name)
    assert info['test_accuracy'] == pytest.approx(result.accuracy)
    assert len(info['history']['epoch']) == info['recipe']['epochs']


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
