"""Qwen2.5-VL's processor for images only: transformers' Qwen2_5_VLProcessor needs torchvision (its video
processor) to be built at all; this is the same processor with no video part."""

from transformers import ProcessorMixin
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor


class Qwen2_5_VLImageProcessor(Qwen2_5_VLProcessor):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
