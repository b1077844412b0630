build/dmuon simulate --model qwen2.5-7b --profile a800 --plot docs/sim-qwen7b-a800.png --json
