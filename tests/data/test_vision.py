"""rl_data.vision: image loading, the Qwen2-VL placeholder layout, and images on records and batches."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from rl_data import ExperienceBatch, ImageInputs, Trajectory, build_experience, decode, encode
from rl_data.vision import VisionProcessor, load_image


@pytest.fixture(scope="module")
def processor(tiny_vl_checkpoint):
    return VisionProcessor.from_pretrained(tiny_vl_checkpoint)


def _image(colour, size=(56, 56)):
    return Image.new("RGB", size, colour)


def test_render_expands_one_run_per_image(processor):
    ids, inputs, text = processor.render(
        "<image>and<image>which is red?", [_image("red"), _image("blue", (112, 56))]
    )
    assert text.count("<|image_pad|>") == 2
    counts = processor.num_image_tokens(inputs.grid_thw)
    # 56×56 → 4×4 patches → 4 tokens; 112×56 → 4×8 patches → 8 tokens (merge 2×2)
    assert inputs.grid_thw.tolist() == [[1, 4, 4], [1, 4, 8]]
    assert counts == [4, 8]
    assert int((ids == processor.image_token_id).sum()) == 12
    assert inputs.pixel_values.shape[0] == 16 + 32
    collapsed = processor.collapse(ids)
    assert collapsed.count(processor.image_token_id) == 2
    assert torch.equal(processor.expand(collapsed, inputs.grid_thw), ids)
    # the originals are kept losslessly, for engines that process images themselves
    assert [image.getpixel((0, 0)) for image in inputs.pil_images()] == [(255, 0, 0), (0, 0, 255)]


def test_render_counts_placeholders_against_images(processor):
    with pytest.raises(ValueError, match="1 image placeholders in the messages but 2 images"):
        processor.render("<image> what?", [_image("red"), _image("red")])
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": _image("green")}, {"type": "text", "text": "?"}],
        }
    ]
    ids, inputs, _ = processor.render(messages, [])
    assert inputs.num_images == 1
    assert int((ids == processor.image_token_id).sum()) == 4


def test_image_turn_layout(processor):
    ids, inputs = processor.image_turn([_image("red")])
    assert ids.tolist() == [
        processor.vision_start_token_id,
        *[processor.image_token_id] * 4,
        processor.vision_end_token_id,
    ]
    assert inputs.grid_thw.tolist() == [[1, 4, 4]]


def test_load_image_sources(tmp_path, monkeypatch):
    image = _image((1, 2, 3))
    image.save(tmp_path / "a.png")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    for value in (
        image,
        buffer.getvalue(),
        "a.png",
        {"bytes": buffer.getvalue(), "path": None},
        {"path": str(tmp_path / "a.png")},
    ):
        assert load_image(value, base_dir=tmp_path).getpixel((0, 0)) == (1, 2, 3)
    with pytest.raises(FileNotFoundError, match=r"row 3.*missing\.png"):
        load_image("missing.png", where="row 3", base_dir=tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="is a URL and the hub is offline"):
        load_image("https://example.com/a.png", where="row 0")
    with pytest.raises(TypeError, match="expected an image"):
        load_image(3, where="row 0")


def test_not_a_vision_model(tiny_checkpoint):
    with pytest.raises(ValueError, match="is not a vision-language model"):
        VisionProcessor.from_pretrained(tiny_checkpoint)


def _record(processor, colours, response=(5, 6)):
    ids, inputs, _ = processor.render(
        "".join("<image>" for _ in colours) + "colour?", [_image(c) for c in colours]
    )
    return Trajectory(prompt_ids=ids, response_ids=list(response), images=inputs)


def test_images_travel_with_records_and_batches(processor):
    records = [
        _record(processor, ["red"]),
        Trajectory(prompt_ids=[1, 2], response_ids=[3]),
        _record(processor, ["blue", "green"]),
    ]
    back = decode(encode(records), list[Trajectory])
    assert back[1].images is None
    assert back[2].images.num_images == 2
    assert torch.equal(back[2].images.pixel_values, records[2].images.pixel_values)
    batch = build_experience(back)
    assert batch.image_counts.tolist() == [1, 0, 2]
    assert batch.image_grid_thw.shape == (3, 3)
    picked = batch.select([2, 1])
    assert picked.image_counts.tolist() == [2, 0]
    assert torch.equal(picked.pixel_values, records[2].images.pixel_values)
    assert torch.equal(picked.image_grid_thw, records[2].images.grid_thw)
    assert batch.select([1]).pixel_values.shape[0] == 0
    assert decode(encode(batch), ExperienceBatch).image_counts.tolist() == [1, 0, 2]
    assert build_experience(records[1:2]).pixel_values is None


def test_image_inputs_checks_shapes():
    with pytest.raises(ValueError, match="16 patches, but grid_thw"):
        ImageInputs(pixel_values=torch.zeros(16, 8), grid_thw=torch.tensor([[1, 2, 2]]))


def test_prompt_dataset_with_images(processor, tmp_path):
    import json

    from rl_data.datasets import PromptDataset

    (tmp_path / "img").mkdir()
    _image("red").save(tmp_path / "img" / "red.png")
    _image("blue", (112, 56)).save(tmp_path / "img" / "blue.png")
    rows = [
        {"prompt": "<image>What colour?", "images": ["img/red.png"], "label": "red"},
        {"prompt": "<image>Colour?", "images": ["img/blue.png"], "label": "blue"},
        {"prompt": "No image here.", "images": None, "label": "none"},
        {"prompt": "<image><image>Two?", "images": ["img/red.png", "img/blue.png"], "label": "two"},
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    dataset = PromptDataset(
        path, processor.tokenizer, image_key="images", processor=processor, on_bad_row="skip"
    )
    assert len(dataset) == 3  # the two-image row is over max_images_per_prompt 1
    assert dataset.stats.skipped == {"bad_prompt": 1}
    red, blue, text = dataset[0], dataset[1], dataset[2]
    assert red.images.grid_thw.tolist() == [[1, 4, 4]]
    assert int((red.prompt_ids == processor.image_token_id).sum()) == 4
    assert int((blue.prompt_ids == processor.image_token_id).sum()) == 8
    assert text.images is None
    assert dataset.lengths.tolist() == [sample.prompt_ids.numel() for sample in (red, blue, text)]
    # the same prompt rendered directly gives the same ids and patches
    ids, inputs, _ = processor.render("<image>What colour?", [_image("red")])
    assert torch.equal(red.prompt_ids, ids)
    assert torch.equal(red.images.pixel_values, inputs.pixel_values)
    two = PromptDataset(
        path, processor.tokenizer, image_key="images", processor=processor, max_images_per_prompt=2
    )
    assert two[3].images.num_images == 2
    # chat messages whose content is a list of parts (Arrow gives every part every key)
    parts = [{"type": "image"}, {"type": "text", "text": "Colour?"}]
    chat = tmp_path / "chat.jsonl"
    chat.write_text(
        json.dumps({"prompt": [{"role": "user", "content": parts}], "images": ["img/blue.png"], "label": "b"})
    )
    assert torch.equal(
        PromptDataset(chat, processor.tokenizer, image_key="images", processor=processor)[0].prompt_ids,
        blue.prompt_ids,
    )
    with pytest.raises(ValueError, match="images need the model's processor"):
        PromptDataset(path, processor.tokenizer, image_key="images")
    (tmp_path / "img" / "red.png").unlink()
    from rl_data import DataError

    with pytest.raises(DataError, match=r"row 0.*red\.png does not exist"):
        PromptDataset(
            path, processor.tokenizer, image_key="images", processor=processor, max_images_per_prompt=2
        )


def test_prompt_dataset_reads_a_hub_image_column(processor):
    """A `datasets.Dataset` with an `Image` feature (what a Hub VQA dataset loads as): its images
    arrive as PIL images or {"bytes", "path"} dicts, and both place like files."""
    import datasets

    from rl_data.datasets import PromptDataset

    buffer = io.BytesIO()
    _image("green").save(buffer, format="PNG")
    rows = {
        "prompt": ["<image>Colour?", "<image>Colour?"],
        "images": [[_image("red")], [{"bytes": buffer.getvalue(), "path": None}]],
    }
    features = datasets.Features(
        {"prompt": datasets.Value("string"), "images": datasets.Sequence(datasets.Image())}
    )
    dataset = datasets.Dataset.from_dict(rows, features=features)
    prompts = PromptDataset(dataset, processor.tokenizer, image_key="images", processor=processor)
    red, green = prompts[0], prompts[1]
    assert red.images.pil_images()[0].getpixel((0, 0)) == (255, 0, 0)
    assert green.images.pil_images()[0].getpixel((0, 0)) == (0, 128, 0)
    assert torch.equal(red.prompt_ids, green.prompt_ids)  # same size, same layout


# ----------------------------------------------------------------------------- untrusted rows


def _write_rows(path, rows) -> None:
    import json

    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_image_paths_outside_the_data_folder_are_refused_naming_the_row_and_key(processor, tmp_path):
    from rl_data import DataError
    from rl_data.datasets import PromptDataset

    data, outside = tmp_path / "data", tmp_path / "elsewhere"
    data.mkdir()
    outside.mkdir()
    _image("red").save(outside / "red.png")
    _image("blue").save(data / "blue.png")
    for bad in (str(outside / "red.png"), "../elsewhere/red.png", "sub/../../elsewhere/red.png"):
        path = data / "rows.jsonl"
        _write_rows(
            path,
            [
                {"prompt": "<image>Colour?", "images": ["blue.png"]},
                {"prompt": "<image>Colour?", "images": [bad]},
            ],
        )
        with pytest.raises(
            DataError, match=r"rows\.jsonl.*row 1.*images.*outside .*data.*image_root"
        ) as refused:
            PromptDataset(path, processor.tokenizer, image_key="images", processor=processor)
        assert bad in str(refused.value)
        skipped = PromptDataset(
            path, processor.tokenizer, image_key="images", processor=processor, on_bad_row="skip"
        )
        assert len(skipped) == 1
        for root in (tmp_path, "/"):  # allowed by the user: a folder that holds both, or anywhere
            allowed = PromptDataset(
                path, processor.tokenizer, image_key="images", processor=processor, image_root=root
            )
            assert allowed[1].images.pil_images()[0].getpixel((0, 0)) == (255, 0, 0)


@pytest.fixture
def image_server(monkeypatch):
    """(base URL, requests served): a local HTTP server of /red.png and /huge.png."""
    import http.server
    import threading

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "http_proxy", "HTTP_PROXY"):
        monkeypatch.delenv(name, raising=False)
    buffer = io.BytesIO()
    _image("red").save(buffer, format="PNG")
    bodies = {"/red.png": buffer.getvalue(), "/huge.png": buffer.getvalue() + b"\0" * 4096}
    served = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            served.append(self.path)
            body = bodies[self.path]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", served, len(bodies["/red.png"])
    server.shutdown()
    server.server_close()


def test_an_image_url_is_fetched_once_and_its_bytes_are_capped(
    processor, tmp_path, image_server, monkeypatch
):
    from rl_data import DataError, vision
    from rl_data.datasets import PromptDataset

    base, served, size = image_server
    path = tmp_path / "rows.jsonl"
    _write_rows(path, [{"prompt": "<image>Colour?", "images": [f"{base}/red.png"]}])
    dataset = PromptDataset(path, processor.tokenizer, image_key="images", processor=processor)
    for _ in range(3):
        assert dataset[0].images.pil_images()[0].getpixel((0, 0)) == (255, 0, 0)
    assert served == ["/red.png"]  # at load, never again when sampled
    monkeypatch.setattr(vision, "MAX_URL_BYTES", size + 100)
    _write_rows(path, [{"prompt": "<image>Colour?", "images": [f"{base}/huge.png"]}])
    with pytest.raises(DataError, match=r"row 0.*huge\.png sends more than \d+ bytes"):
        PromptDataset(path, processor.tokenizer, image_key="images", processor=processor)
