-- Argo CD health of a sessionfleet.dev/v1alpha1 WorkerCheckpoint, from the phase the
-- operator writes. Lua 5.1, the dialect of Argo CD's gopher-lua.
local hs = {}
local status = obj.status
if status == nil or status.phase == nil or status.phase == "Pending" then
  hs.status = "Progressing"
  hs.message = "Waiting for the checkpoint of worker " .. obj.spec.worker .. " to start"
elseif status.phase == "Running" then
  hs.status = "Progressing"
  hs.message = "Writing the checkpoint of worker " .. obj.spec.worker
elseif status.phase == "Succeeded" then
  hs.status = "Healthy"
  if status.sizeBytes ~= nil then
    hs.message = "Written: " .. status.sizeBytes .. " bytes"
  else
    hs.message = "Written"
  end
elseif status.phase == "Failed" then
  hs.status = "Degraded"
  hs.message = status.error or "The checkpoint could not be written"
else
  hs.status = "Unknown"
  hs.message = "Unknown phase " .. status.phase
end
return hs
