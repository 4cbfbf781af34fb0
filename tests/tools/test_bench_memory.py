from tools.bench import memory


def test_weight_bytes_count_the_tied_embedding_once(artifact_dir, hf_model):
    params = [4 * p.numel() for p in {id(p): p for p in hf_model.parameters()}.values()]  # lm_head is embed_tokens
    # the exporter stores equal tensors once (zero biases, unit layer norms of a fresh model)
    assert sum(n for n in params if n >= 1024) < memory.weight_bytes(artifact_dir) <= sum(params)


def test_prints_a_row_per_artifact_with_its_ratio(artifact_dir, capsys):
    assert memory.main([str(artifact_dir), "--tokens", "24", "--prompt", "8"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| artifact | dtype | weights MiB | load + generate peak RSS MiB | ratio |")
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[0] == str(artifact_dir) and cells[1] == "float32"
    assert float(cells[4].rstrip("x")) > 1  # a process costs more than its weights
    anonymous, mapped, other = (float(x.replace(",", "")) for x in cells[6].split(" / "))
    assert anonymous > 0 and other > 0 and mapped >= 0


def test_resident_split_adds_up_to_the_rss(generator):
    from export.measure import status_bytes, resident_by_mapping

    generator.generate("Hello", 4)  # an artifact's weights.bin is mapped in this process
    parts = resident_by_mapping()
    rss = status_bytes("VmRSS")
    assert all(v > 0 for v in parts.values()), parts
    assert abs(sum(parts.values()) - rss) < 0.02 * rss
