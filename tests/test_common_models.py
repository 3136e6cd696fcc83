"""transformers' own common model tests (`ModelTesterMixin`, `ConfigTester`) run against the DAMCHA GPT-2, Llama, ViT,
BART, Mistral, Qwen2, Qwen3, Phi-3 and Gemma 2 classes, as transformers runs them against its own.

The mixins come from the installed transformers release's own sdist (`upstream_common_tests.py`: downloaded once per
version into a cache outside the repository); without a reachable package index this file skips with the reason.
GPT-2, Llama, ViT and BART run twice: with the metric generator's output layer at zero (a fresh DAMCHA model, exactly
multi-head attention) and with random non-zero generator weights (a trained one), so that the contract holds where
the cross-head metric really changes the attention; Mistral, Qwen2, Qwen3, Phi-3 and Gemma 2, whose attention is
Llama's with their own details, run once, with random generator weights. Generation is covered by `tests/test_contract.py`.

Run with `python -m pytest -m common` (left out of the default suite for time).
"""

import contextlib
import inspect
import unittest
from unittest import mock

import pytest
import torch
from parameterized import parameterized
from tiny_decoders import STOCK_CONFIGS, tiny_damcha_config
from torch import nn
from transformers import GPT2DoubleHeadsModel
from transformers.models.auto.auto_factory import get_values
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES,
    MODEL_MAPPING_NAMES,
)
from upstream_common_tests import CommonTestsUnavailable, import_common_tests

from damcha_hf import DamchaBartConfig, DamchaGPT2Config, DamchaLlamaConfig, DamchaViTConfig
from damcha_hf.families import BART_FAMILY, FAMILIES, GPT2_FAMILY, LLAMA_FAMILY, VIT_FAMILY, family_for_model_type
from damcha_hf.modeling import modeling_damcha_bart

pytestmark = pytest.mark.common

try:
    upstream = import_common_tests()
except CommonTestsUnavailable as error:
    pytest.skip(f"transformers' common tests are taken from its sdist, which is unavailable: {error}",
                allow_module_level=True)  # fmt: skip
common_module = upstream["test_modeling_common"]
ModelTesterMixin = common_module.ModelTesterMixin
floats_tensor = upstream["test_modeling_common"].floats_tensor
ids_tensor = upstream["test_modeling_common"].ids_tensor
random_attention_mask = upstream["test_modeling_common"].random_attention_mask
ConfigTester = upstream["test_configuration_common"].ConfigTester
GenerationTesterMixin = upstream["test_modeling_common"].GenerationTesterMixin
# Whether the mixin's gradient-checkpointing check tells a gradient of rounding size from a real one (see
# `DamchaTesterMixin._classes_with_a_loss`).
GRADIENT_CHECK_FILTERS_ROUNDING = "_fp_noise" in inspect.getsource(
    ModelTesterMixin.check_training_gradient_checkpointing
)


def stock_class_of(model_class) -> type:
    for family in FAMILIES:
        head = family.head_of(model_class)
        if head is not None and head.model_class is model_class:
            return head.stock_class
    raise KeyError(model_class)


def is_generator_output_layer(module_name: str) -> bool:
    """The metric generator's output layer, by its checkpoint name (`...cross_head_metric.generators.0.fc_out`)."""
    return ".cross_head_metric." in f".{module_name}." and module_name.endswith(".fc_out")


class DamchaTesterMixin(ModelTesterMixin):
    """What both families' test classes add to `ModelTesterMixin`."""

    # Random non-zero generator weights wherever a model is built (its `_init_weights` runs on every construction).
    random_generator = False
    stack_classes: tuple[type, ...] = ()
    # The mixin skips this check for models whose config file carries no copyright year of 2023 or later ("not a
    # prioritized model"), which the DAMCHA files carry none of: every weight must be set by `_init_weights`.
    test_can_init_all_missing_weights_before_2023 = True

    def setUp(self):
        if self.random_generator:
            # The weight init starts the generator's output layer at zero: follow it with random weights there, in
            # `_init_weights` itself, so that a model built by `__init__` and one whose weights `from_pretrained`
            # initialises (the mixin compares the two) get the same ones.
            # A model's layer stacks (BART's encoder and decoder) are models of their own, initialised by their own
            # class's `_init_weights`: those are patched too.
            for model_class in (*self.all_model_classes, *self.stack_classes):
                original = model_class._init_weights

                def init_then_randomize_the_generator_output(model, module, original=original):
                    original(model, module)
                    output_layers = [m for n, m in model.named_modules() if is_generator_output_layer(n)]
                    if any(module is layer for layer in output_layers):
                        nn.init.normal_(module.weight, std=0.5)
                        nn.init.normal_(module.bias, std=0.5)

                patcher = mock.patch.object(model_class, "_init_weights", init_then_randomize_the_generator_output)
                patcher.start()
                self.addCleanup(patcher.stop)
        self.set_up_testers()

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        # The mixin picks labels by the class name in transformers' Auto mappings: answer with the stock class's.
        inputs = super()._prepare_for_class(inputs_dict, stock_class_of(model_class), return_labels=return_labels)
        if return_labels and stock_class_of(model_class) is GPT2DoubleHeadsModel:
            # As transformers' own GPT-2 test does: `num_choices` copies of each sequence, the last token of each
            # scored by the multiple-choice head, and labels for both heads, so that every weight gets a gradient.
            batch, choices = self.model_tester.batch_size, self.model_tester.num_choices
            for key in ("input_ids", "attention_mask"):
                inputs[key] = inputs[key].unsqueeze(1).expand(-1, choices, -1).contiguous()
            inputs["labels"] = inputs["input_ids"]
            inputs["mc_token_ids"] = torch.full((batch, choices), self.model_tester.seq_length - 1)
            inputs["mc_labels"] = torch.zeros(batch, dtype=torch.long)
        return inputs

    @contextlib.contextmanager
    def _classes_with_a_loss(self, loss_reaches_every_weight=False):
        """The training tests skip base models by their name in transformers' Auto mappings (they return no loss),
        which a DAMCHA class name is not: leave them out by their stock class instead.

        `loss_reaches_every_weight`: also leave out the double-heads model, whose `loss` is the language-modelling
        loss alone (the multiple-choice loss comes separately, as `mc_loss`, as in stock GPT2DoubleHeadsModel), so
        that its multiple-choice head gets no gradient from it. Where the installed mixin's gradient-checkpointing
        check takes a gradient of 0.0 in one run and of rounding size in the other for a mismatch (before transformers
        fixed that flakiness, huggingface/transformers#48332; 5.16's check), also leave out the question-answering
        heads: their output bias has a zero gradient in exact arithmetic (the softmax over positions cancels it), so
        that check fails on them by rounding, at random.
        """
        left_out = set(MODEL_MAPPING_NAMES.values()) | (
            {"GPT2DoubleHeadsModel"} if loss_reaches_every_weight else set()
        )
        if loss_reaches_every_weight and not GRADIENT_CHECK_FILTERS_ROUNDING:
            left_out |= set(get_values(MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES))
        every_class = self.all_model_classes
        self.all_model_classes = tuple(c for c in every_class if stock_class_of(c).__name__ not in left_out)
        try:
            yield
        finally:
            self.all_model_classes = every_class

    def test_training(self):
        with self._classes_with_a_loss():
            super().test_training()

    def test_training_gradient_checkpointing(self):
        with self._classes_with_a_loss(loss_reaches_every_weight=True):
            super().test_training_gradient_checkpointing()

    def test_training_gradient_checkpointing_use_reentrant_false(self):
        with self._classes_with_a_loss(loss_reaches_every_weight=True):
            super().test_training_gradient_checkpointing_use_reentrant_false()

    def test_training_gradient_checkpointing_use_reentrant_true(self):
        with self._classes_with_a_loss(loss_reaches_every_weight=True):
            super().test_training_gradient_checkpointing_use_reentrant_true()

    def _listed_like_their_stock_classes(self, mapping_names: dict):
        """Some tests find the heads they check by class name in one of transformers' Auto mappings, which DAMCHA's
        names are not in: list, for such a test, each DAMCHA class whose stock class is there."""
        stock_names = set(get_values(mapping_names))
        damcha_names = {f"damcha:{c.__name__}": c.__name__ for c in self.all_model_classes
                        if stock_class_of(c).__name__ in stock_names}  # fmt: skip
        return mock.patch.dict(mapping_names, damcha_names)

    # Each override below exists only where the installed release's mixin has the test it wraps (transformers 5.16's
    # has neither the shift-labels nor the partial-rotation test), so that no release runs a test upstream lacks.
    if hasattr(ModelTesterMixin, "test_causal_lm_loss_honors_shift_labels"):

        def test_causal_lm_loss_honors_shift_labels(self):
            # It also leaves out the heads whose stock class takes its labels unshifted (BartForCausalLM), by name.
            unshifted = common_module.UNSHIFTED_LM_HEADS | {
                c.__name__
                for c in self.all_model_classes
                if stock_class_of(c).__name__ in common_module.UNSHIFTED_LM_HEADS
            }
            with (
                self._listed_like_their_stock_classes(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
                mock.patch.object(common_module, "UNSHIFTED_LM_HEADS", unshifted),
            ):
                super().test_causal_lm_loss_honors_shift_labels()

    # The RoPE tests look for the base model (`LlamaModel`) by name; GPT-2 and ViT skip them (no RoPE).
    def test_model_rope_scaling_from_config_0_linear(self):
        with self._listed_like_their_stock_classes(MODEL_MAPPING_NAMES):
            super().test_model_rope_scaling_from_config_0_linear()

    def test_model_rope_scaling_from_config_1_dynamic(self):
        with self._listed_like_their_stock_classes(MODEL_MAPPING_NAMES):
            super().test_model_rope_scaling_from_config_1_dynamic()

    def test_model_rope_scaling_from_config_2_yarn(self):
        with self._listed_like_their_stock_classes(MODEL_MAPPING_NAMES):
            super().test_model_rope_scaling_from_config_2_yarn()

    def test_model_rope_scaling_frequencies(self):
        with self._listed_like_their_stock_classes(MODEL_MAPPING_NAMES):
            super().test_model_rope_scaling_frequencies()

    if hasattr(ModelTesterMixin, "test_model_rope_with_partial_rotation"):

        def test_model_rope_with_partial_rotation(self):
            with self._listed_like_their_stock_classes(MODEL_MAPPING_NAMES):
                super().test_model_rope_with_partial_rotation()

    @unittest.skip(
        "A DAMCHA checkpoint without its metric-generator weights is refused at load (DamchaPreTrainedMixin."
        "from_pretrained), rather than loaded as plain multi-head attention; this test deletes every weight on file "
        "and expects a load that reports them missing."
    )
    def test_model_weights_reload_no_missing_tied_weights(self):
        pass

    def test_generator_is_zero_or_random_as_this_class_says(self):
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        model = self.all_model_classes[0](config)
        output_layers = [m for n, m in model.named_modules() if is_generator_output_layer(n)]
        self.assertTrue(output_layers)
        for layer in output_layers:
            for parameter in (layer.weight, layer.bias):
                self.assertEqual(bool(parameter.abs().min() > 0), self.random_generator)
                self.assertEqual(bool(parameter.abs().max() == 0), not self.random_generator)


# --- GPT-2 ------------------------------------------------------------------------------------------------------------


class DamchaGPT2ModelTester:
    def __init__(self, parent, batch_size=2, seq_length=7, vocab_size=99, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=4, metric_context="token"):  # fmt: skip
        self.parent = parent
        self.batch_size, self.seq_length, self.vocab_size = batch_size, seq_length, vocab_size
        self.hidden_size, self.num_hidden_layers = hidden_size, num_hidden_layers
        self.num_attention_heads, self.metric_context = num_attention_heads, metric_context
        self.is_training = True
        self.num_labels, self.num_choices = 3, 4

    def get_config(self) -> DamchaGPT2Config:
        return DamchaGPT2Config(
            vocab_size=self.vocab_size,
            n_embd=self.hidden_size,
            n_layer=self.num_hidden_layers,
            n_head=self.num_attention_heads,
            n_inner=37,
            n_positions=64,
            resid_pdrop=0.1,
            embd_pdrop=0.1,
            attn_pdrop=0.1,
            num_labels=self.num_labels,
            bos_token_id=self.vocab_size - 1,
            eos_token_id=self.vocab_size - 1,
            pad_token_id=self.vocab_size - 1,
            metric_hidden_size=8,
            metric_context=self.metric_context,
        )

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size - 1)
        attention_mask = random_attention_mask([self.batch_size, self.seq_length])
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


class DamchaGPT2CommonTest(DamchaTesterMixin, GenerationTesterMixin, unittest.TestCase):
    all_model_classes = tuple(head.model_class for head in GPT2_FAMILY.heads)

    def set_up_testers(self):
        self.model_tester = DamchaGPT2ModelTester(self)
        self.config_tester = ConfigTester(self, config_class=DamchaGPT2Config, n_embd=36, n_head=12)

    def test_config(self):
        self.config_tester.run_common_tests()


class DamchaGPT2RandomGeneratorCommonTest(DamchaGPT2CommonTest):
    random_generator = True


# --- Llama ------------------------------------------------------------------------------------------------------------


class DamchaLlamaModelTester:
    """As transformers' Llama tester (its `CausalLMModelTester` sizes), grouped-query by default: 4 query heads share
    2 key/value heads, so the metric is `H_kv x H_kv` and the cache keeps its GQA size."""

    def __init__(self, parent, batch_size=2, seq_length=7, vocab_size=99, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, metric_context="token"):  # fmt: skip
        self.parent = parent
        self.batch_size, self.seq_length, self.vocab_size = batch_size, seq_length, vocab_size
        self.hidden_size, self.num_hidden_layers = hidden_size, num_hidden_layers
        self.num_attention_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
        self.metric_context = metric_context
        self.is_training = True
        self.num_labels = 3

    def get_config(self) -> DamchaLlamaConfig:
        return DamchaLlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            intermediate_size=37,
            max_position_embeddings=512,
            attention_dropout=0.1,
            num_labels=self.num_labels,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            metric_hidden_size=8,
            metric_context=self.metric_context,
        )

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = random_attention_mask([self.batch_size, self.seq_length])
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


class DamchaLlamaCommonTest(DamchaTesterMixin, GenerationTesterMixin, unittest.TestCase):
    all_model_classes = tuple(head.model_class for head in LLAMA_FAMILY.heads)

    def set_up_testers(self):
        self.model_tester = DamchaLlamaModelTester(self)
        # A width the heads divide (stock LlamaConfig refuses hidden_size=37 with its default 32 heads too), and
        # key/value heads that divide the query heads, as the GPT-2 and ViT config tests do.
        self.config_tester = ConfigTester(
            self, config_class=DamchaLlamaConfig, hidden_size=36, num_attention_heads=12, num_key_value_heads=4
        )

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_grouped_query_attention_is_what_runs(self):
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        model = self.all_model_classes[0](config)
        attention = model.layers[0].self_attn
        self.assertEqual(attention.k_proj.out_features, 2 * attention.head_dim)
        self.assertEqual(attention.q_proj.out_features, 4 * attention.head_dim)


class DamchaLlamaRandomGeneratorCommonTest(DamchaLlamaCommonTest):
    random_generator = True


# --- Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 ----------------------------------------------------------------------------


class DamchaDecoderModelTester(DamchaLlamaModelTester):
    """The Llama tester's sizes (transformers' `CausalLMModelTester`: 4 query heads sharing 2 key/value heads) for a
    rotary decoder family, with its details on (`tiny_decoders.py`: sliding windows of 4 in the 7-token inputs,
    Qwen2's biases, Qwen3's q/k norms, Phi-3's fused projection and partial rotation, Gemma 2's soft-cap and scale)."""

    def __init__(self, parent, model_type: str, **sizes):
        super().__init__(parent, **sizes)
        self.model_type = model_type

    def get_config(self):
        return tiny_damcha_config(
            self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            intermediate_size=37,
            max_position_embeddings=512,
            attention_dropout=0.1,
            initializer_range=0.02,
            num_labels=self.num_labels,
            metric_hidden_size=8,
            metric_context=self.metric_context,
        )


def decoder_common_test(model_type: str) -> type:
    """The common tests of a rotary decoder family, run once, with random non-zero generator weights: the zero
    generator is the stock model (test_families.py checks conversion equals it), and the random one is where the
    cross-head metric changes the attention."""
    family = family_for_model_type(model_type)

    class DecoderCommonTest(DamchaTesterMixin, GenerationTesterMixin, unittest.TestCase):
        all_model_classes = tuple(head.model_class for head in family.heads)
        random_generator = True

        def set_up_testers(self):
            self.model_tester = DamchaDecoderModelTester(self, model_type)
            self.config_tester = ConfigTester(self, config_class=family.config_class, hidden_size=36,
                                              num_attention_heads=12, num_key_value_heads=4)  # fmt: skip

        def test_config(self):
            self.config_tester.run_common_tests()

    for test_name, reason in STOCK_SKIPS.get(model_type, {}).items():
        setattr(DecoderCommonTest, test_name, unittest.skip(reason)(lambda self: None))
    DecoderCommonTest.__name__ = DecoderCommonTest.__qualname__ = f"{family.config_class.__name__[:-6]}CommonTest"
    return DecoderCommonTest


# Tests the stock config of a family refuses the inputs of, by the stock config's own check.
PHI3_ROPE = ("Phi-3's config takes only `longrope` scaling: stock Phi3Config refuses the linear, dynamic and yarn "
             "scaling this test sets (`validate_rope`)")  # fmt: skip
STOCK_SKIPS = {
    "phi3": {f"test_model_rope_scaling_from_config_{case}": PHI3_ROPE for case in ("0_linear", "1_dynamic", "2_yarn")}
}


DamchaMistralCommonTest = decoder_common_test("mistral")
DamchaQwen2CommonTest = decoder_common_test("qwen2")
DamchaQwen3CommonTest = decoder_common_test("qwen3")
DamchaPhi3CommonTest = decoder_common_test("phi3")
DamchaGemma2CommonTest = decoder_common_test("gemma2")
DECODER_COMMON_TESTS = (DamchaMistralCommonTest, DamchaQwen2CommonTest, DamchaQwen3CommonTest, DamchaPhi3CommonTest,
                        DamchaGemma2CommonTest)  # fmt: skip


# --- ViT --------------------------------------------------------------------------------------------------------------


class DamchaViTModelTester:
    def __init__(self, parent, batch_size=2, image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                 num_hidden_layers=2, num_attention_heads=4, metric_context="sequence"):  # fmt: skip
        self.parent = parent
        self.batch_size, self.image_size, self.patch_size = batch_size, image_size, patch_size
        self.num_channels, self.hidden_size = num_channels, hidden_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.metric_context = metric_context
        self.is_training = True
        self.num_labels = 3
        num_patches = (image_size // patch_size) ** 2
        self.seq_length = num_patches + 1  # the patches and the CLS token
        # Masked image modelling: the mixin masks `num_masks` of the `mask_length` patches (the CLS token is never).
        self.mask_length, self.num_masks = num_patches, num_patches // 2

    def get_config(self) -> DamchaViTConfig:
        return DamchaViTConfig(
            image_size=self.image_size,
            patch_size=self.patch_size,
            num_channels=self.num_channels,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            intermediate_size=37,
            hidden_dropout_prob=0.1,
            attention_probs_dropout_prob=0.1,
            num_labels=self.num_labels,
            encoder_stride=self.patch_size,  # masked image modelling reconstructs at the patch size
            metric_hidden_size=8,
            metric_context=self.metric_context,
        )

    def prepare_config_and_inputs_for_common(self):
        pixel_values = floats_tensor([self.batch_size, self.num_channels, self.image_size, self.image_size])
        return self.get_config(), {"pixel_values": pixel_values}


class DamchaViTCommonTest(DamchaTesterMixin, unittest.TestCase):
    all_model_classes = tuple(head.model_class for head in VIT_FAMILY.heads)
    test_resize_embeddings = False  # ViT has no token embeddings to resize (as transformers' own ViT test says)

    def set_up_testers(self):
        self.model_tester = DamchaViTModelTester(self)
        self.config_tester = ConfigTester(
            self, config_class=DamchaViTConfig, has_text_modality=False, hidden_size=36, num_attention_heads=12
        )

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_model_get_set_embeddings(self):
        # ViT's input embeddings are its patch embeddings (a convolution), not an nn.Embedding; transformers' own ViT
        # test checks them the same way.
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = model_class(config)
            self.assertIsInstance(model.get_input_embeddings(), nn.Module)
            output_embeddings = model.get_output_embeddings()
            self.assertTrue(output_embeddings is None or isinstance(output_embeddings, nn.Linear))


class DamchaViTRandomGeneratorCommonTest(DamchaViTCommonTest):
    random_generator = True


# --- BART -------------------------------------------------------------------------------------------------------------


class DamchaBartModelTester:
    """As transformers' BART tester: sources ending in </s> (the sequence classifier reads the last </s>), decoder
    inputs, both attention masks; `decoder_only` gives the inputs of BART's decoder alone (`BartForCausalLM`)."""

    def __init__(self, parent, batch_size=2, seq_length=7, vocab_size=99, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=4, metric_context="token", decoder_only=False):  # fmt: skip
        self.parent = parent
        self.batch_size, self.seq_length, self.vocab_size = batch_size, seq_length, vocab_size
        self.hidden_size, self.num_hidden_layers = hidden_size, num_hidden_layers
        self.num_attention_heads, self.metric_context = num_attention_heads, metric_context
        self.decoder_only = decoder_only
        self.is_training = True
        self.num_labels = 3
        self.encoder_seq_length = self.decoder_seq_length = seq_length

    def get_config(self) -> DamchaBartConfig:
        return DamchaBartConfig(
            vocab_size=self.vocab_size,
            d_model=self.hidden_size,
            encoder_layers=self.num_hidden_layers,
            decoder_layers=self.num_hidden_layers,
            encoder_attention_heads=self.num_attention_heads,
            decoder_attention_heads=self.num_attention_heads,
            encoder_ffn_dim=37,
            decoder_ffn_dim=37,
            max_position_embeddings=64,
            dropout=0.1,
            attention_dropout=0.1,
            num_labels=self.num_labels,
            bos_token_id=0,
            pad_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=2,
            is_encoder_decoder=not self.decoder_only,
            is_decoder=self.decoder_only,
            metric_hidden_size=8,
            metric_context=self.metric_context,
        )

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size - 3) + 3
        if self.decoder_only:
            attention_mask = random_attention_mask([self.batch_size, self.seq_length])
            return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}
        input_ids[:, -1] = 2
        decoder_input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size - 3) + 3
        return self.get_config(), {
            "input_ids": input_ids,
            "attention_mask": input_ids.ne(1),
            "decoder_input_ids": decoder_input_ids,
            "decoder_attention_mask": decoder_input_ids.ne(1),
        }


BART_ENCODER_DECODER_CLASSES = tuple(head.model_class for head in BART_FAMILY.heads
                                     if head.auto_class != "AutoModelForCausalLM")  # fmt: skip


BART_STACKS = (modeling_damcha_bart.DamchaBartEncoder, modeling_damcha_bart.DamchaBartDecoder)


class DamchaBartCommonTest(DamchaTesterMixin, GenerationTesterMixin, unittest.TestCase):
    all_model_classes = BART_ENCODER_DECODER_CLASSES
    stack_classes = BART_STACKS
    is_encoder_decoder = True

    @contextlib.contextmanager
    def _without_the_sequence_classifier(self):
        """Stock BART's sequence classifier reads the last </s> of each source and refuses sources with unequal
        counts of it (padded or embedded ones): transformers' own BART test leaves it out of these tests too."""
        every_class = self.all_model_classes
        self.all_model_classes = tuple(c for c in every_class
                                       if stock_class_of(c).__name__ != "BartForSequenceClassification")  # fmt: skip
        try:
            yield
        finally:
            self.all_model_classes = every_class

    def test_inputs_embeds(self):
        with self._without_the_sequence_classifier():
            super().test_inputs_embeds()

    @parameterized.expand(common_module.TEST_EAGER_MATCHES_SDPA_INFERENCE_PARAMETERIZATION)
    def test_eager_matches_sdpa_inference(self, *parameters):
        # Its padded batches give the sources unequal counts of </s>.
        with self._without_the_sequence_classifier():
            common_module._test_eager_matches_sdpa_inference(self, *parameters)

    def set_up_testers(self):
        self.model_tester = DamchaBartModelTester(self)
        self.config_tester = ConfigTester(self, config_class=DamchaBartConfig, d_model=36, encoder_attention_heads=12,
                                          decoder_attention_heads=12)  # fmt: skip

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_attention_outputs(self):
        # It counts a question-answering model's outputs by finding the class name in the Auto mapping.
        with self._listed_like_their_stock_classes(MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES):
            super().test_attention_outputs()


class DamchaBartRandomGeneratorCommonTest(DamchaBartCommonTest):
    random_generator = True


class DamchaBartDecoderCommonTest(DamchaTesterMixin, GenerationTesterMixin, unittest.TestCase):
    """BART's decoder alone (`DamchaBartForCausalLM`), as transformers tests `BartForCausalLM` on its own."""

    all_model_classes = (BART_FAMILY.head_for_auto_class("AutoModelForCausalLM").model_class,)
    stack_classes = BART_STACKS
    is_encoder_decoder = False

    def set_up_testers(self):
        self.model_tester = DamchaBartModelTester(self, decoder_only=True)

    # The decoder alone never runs its cross-attention layers (stock `BartForCausalLM` neither), so they get no
    # gradient, which these tests require of every weight.
    IDLE_CROSS_ATTENTION = "BART's decoder alone leaves its cross-attention layers idle: they get no gradient"

    @unittest.skip(IDLE_CROSS_ATTENTION)
    def test_training_gradient_checkpointing(self):
        pass

    @unittest.skip(IDLE_CROSS_ATTENTION)
    def test_training_gradient_checkpointing_use_reentrant_false(self):
        pass

    @unittest.skip(IDLE_CROSS_ATTENTION)
    def test_training_gradient_checkpointing_use_reentrant_true(self):
        pass


class DamchaBartDecoderRandomGeneratorCommonTest(DamchaBartDecoderCommonTest):
    random_generator = True


def test_every_head_of_every_family_runs_the_common_tests():
    """Nothing silently left out: each test class covers every head its family declares."""
    assert set(DamchaGPT2CommonTest.all_model_classes) == {head.model_class for head in GPT2_FAMILY.heads}
    assert set(DamchaLlamaCommonTest.all_model_classes) == {head.model_class for head in LLAMA_FAMILY.heads}
    assert set(DamchaViTCommonTest.all_model_classes) == {head.model_class for head in VIT_FAMILY.heads}
    bart_classes = set(DamchaBartCommonTest.all_model_classes) | set(DamchaBartDecoderCommonTest.all_model_classes)
    assert bart_classes == {head.model_class for head in BART_FAMILY.heads}
    for test, model_type in zip(DECODER_COMMON_TESTS, STOCK_CONFIGS, strict=True):
        assert set(test.all_model_classes) == {head.model_class for head in family_for_model_type(model_type).heads}
