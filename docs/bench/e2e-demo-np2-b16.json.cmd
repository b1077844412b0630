mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 build/dmuon bench e2e --config demo --batch 16 --optim adamw,dmuon --steps 8 --tune-cache build/bench-tune-1thread.json --json
