"""Every built-in layer type has at least one independent reference: a golden case made by the
real Caffe, an OpenCV-dnn oracle row, or a test listed in NUMPY_REFERENCE below that checks it
against numbers not produced by brewnet (numpy/float64 by hand, Caffe's own test files/values).
Plugins (``register_layer``: test layers, examples, installed packages) bring their own tests."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import brewnet  # noqa: F401  (imports every layer module, data layers included)
from brewnet.layers.registry import BUILTIN
from helpers import GOLDEN_LAYERS
from opencv_cases import UNIT_CASES

TESTS = Path(__file__).resolve().parent

# type -> "file::test": only tests that compare against an independent reference.
NUMPY_REFERENCE = {
    "Data": ["test_data_layers.py::test_data_layer_through_net"],          # idx-file decode of Caffe's LMDB
    "HDF5Data": ["test_data_layers.py::test_hdf5_data_caffe_test_read"],   # Caffe's sample_data.h5 + its test's values
    "HDF5Output": ["test_data_layers.py::test_hdf5_output_writes_and_appends"],  # read back with h5py
    "ImageData": ["test_data_layers.py::test_image_data_read_and_resize"],  # cv2.imread pixels
    "WindowData": ["test_data_layers.py::test_window_data_samples_and_warps"],  # hand-drawn windows
    "DummyData": ["test_layers_data.py::test_dummy_data_legacy_dims"],     # Caffe's test_dummy_data_layer
    "MemoryData": ["test_layers_data.py::test_memory_data_batches_wrap_around"],  # the arrays fed in
    "Input": ["test_golden_layers.py::test_golden_layer"],                 # every golden net feeds through Input
    "MultiBoxLoss": ["test_layers_detection.py::test_multibox_loss_by_hand"],  # numpy smooth-L1 + softmax NLL
    "DetectionEvaluate": ["test_layers_detection.py::test_detection_evaluate_by_hand"],
    "Python": ["test_pycaffe_extras.py::test_python_layers_chain_forward_backward"],  # Caffe's test_python_layer
    "AnnotatedData": ["test_annotated_data.py::test_plain_records_give_their_boxes"],  # boxes vs drawn pixels
    # The forks' layers: loops written from each fork's own source, hand values, OpenCV.
    "ROIPooling": ["test_layers_rcnn.py::test_roi_pooling_matches_the_fork_loop_and_sends_gradient_to_its_argmax"],
    "PSROIPooling": ["test_layers_rcnn.py::test_psroi_pooling_matches_the_fork_loop_and_gradient"],
    "SmoothL1Loss": ["test_layers_rcnn.py::test_smooth_l1_loss_hand_values_and_gradient"],
    "Proposal": ["test_layers_rcnn.py::test_proposal_matches_opencv"],
    "Interp": ["test_layers_seg.py::test_interp_matches_the_fork_loop"],
    "Upsample": ["test_layers_seg.py::test_segnet_upsample_puts_each_max_back_where_it_was"],
    "BN": ["test_layers_seg.py::test_pspnet_bn_test_and_train_against_numpy"],
    "ShuffleChannel": ["test_layers_forks.py::test_shuffle_channel_order_and_gradient"],
    "DepthwiseConvolution": ["test_layers_forks.py::test_depthwise_convolution_is_the_forks_per_channel_filter"],
    "ConvolutionDepthwise": ["test_layers_forks.py::test_convolution_depthwise_matches_opencv"],
    "ReLU6": ["test_layers_forks.py::test_relu6_formula_kinks_and_gradient"],
    "Axpy": ["test_layers_forks.py::test_axpy_formula_and_gradient"],
    "Reorg": ["test_layers_forks.py::test_reorg_is_the_forks_index_rule"],
    "Region": ["test_layers_forks.py::test_region_outputs_by_hand"],
    "Yolov3DetectionOutput": ["test_layers_forks.py::test_yolov3_detection_output_by_hand"],
    "YoloDetectionOutput": ["test_layers_forks.py::test_yolo_detection_output_by_hand"],
    "Transpose": ["test_layers_ocr.py::test_transpose_is_the_forks_index_rule"],
    "Reverse": ["test_layers_ocr.py::test_reverse_is_the_forks_copy_loop"],
    "Lstm": ["test_layers_ocr.py::test_lstm_forward_is_the_forks_cpu_loop_and_its_gpu_kernels_for_a_batch",
             "test_layers_ocr.py::test_lstm_backward_is_the_forks_with_gate_gradient_clipping"],
    "CTCGreedyDecoder": ["test_layers_ocr.py::test_ctc_greedy_decoder_by_hand"],
    "DenseBlock": ["test_layers_ocr.py::test_dense_block_blobs_and_test_forward_are_the_forks"],
    "AutoCrop": ["test_layers_forks2.py::test_autocrop_finds_rcfs_offsets_and_crops_as_the_fork",
                 "test_layers_forks2.py::test_v1_crop_is_the_coordinate_map_crop_with_fcn8s_offsets"],
    "Unpooling": ["test_layers_forks2.py::test_unpooling_without_mask_matches_the_fork",
                  "test_layers_forks2.py::test_unpooling_with_mask_last_write_wins_and_gathers_back"],
    "Flip": ["test_layers_forks2.py::test_flip_matches_the_fork"],
    "ContinuationIndicator": ["test_layers_forks2.py::test_continuation_indicator_values_and_checks"],
    "Correlation": ["test_layers_flow.py::test_correlation_matches_the_forks_kernels",
                    "test_layers_flow.py::test_correlation_backward_is_the_forks_backward_kernels"],
    "Warp": ["test_layers_flow.py::test_warp_forward_and_backward_match_the_forks_kernels"],
    "DenseImageData": ["test_dense_image_data.py::test_reads_pairs_as_tokens_and_wraps",    # cv2.imread pixels
                       "test_dense_image_data.py::test_mirror_and_crop_move_image_and_label_together"],
    "SpatialDropout": ["test_spatial_dropout.py::test_train_branch_drops_whole_channels",   # the fork's loops
                       "test_spatial_dropout.py::test_test_branch_scales_by_one_over_one_minus_p"],
}


def golden_types() -> set[str]:
    return {c["type"] for c in json.loads((GOLDEN_LAYERS / "index.json").read_text())["cases"]}


def opencv_types() -> set[str]:
    return {t for c in UNIT_CASES for t in re.findall(r'type: "(\w+)"', c.layers)}


def test_listed_reference_tests_exist():
    # A renamed or deleted reference test must not leave a stale row behind.
    for refs in NUMPY_REFERENCE.values():
        for ref in refs:
            file, name = ref.split("::")
            tree = ast.parse((TESTS / file).read_text())
            assert name in {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}, ref


def test_every_registered_type_has_an_independent_reference():
    covered = golden_types() | opencv_types() | set(NUMPY_REFERENCE)
    uncovered = sorted(set(BUILTIN) - covered)
    assert not uncovered, f"built-in types with no golden/OpenCV/numpy reference: {uncovered}"
    assert not set(NUMPY_REFERENCE) - set(BUILTIN), "rows for types that are not built in"
