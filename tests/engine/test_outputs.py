from kvwire.engine.outputs import ModelRunnerOutput, RequestMetrics


def test_request_metrics_first_marks_stick():
    m = RequestMetrics(arrival_time=10.0)
    m.mark_scheduled(11.0)
    m.mark_scheduled(15.0)
    m.mark_first_token(12.5)
    m.mark_first_token(20.0)
    assert m.first_scheduled_time == 11.0 and m.time_in_queue == 1.0
    assert m.ttft == 2.5


def test_model_runner_output_indexes_requests():
    out = ModelRunnerOutput.from_tokens(["a", "b"], [7, 9])
    assert out.req_id_to_index == {"a": 0, "b": 1}
    assert out.sampled_token_ids[out.req_id_to_index["b"]] == [9]
